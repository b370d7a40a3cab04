"""Collectives that move bf16 or block-scaled FP8 bytes and accumulate in fp32.

Planning and execution are apart: a :class:`WireCodec` is the plan for one rank's contribution
of ``numel`` elements (its byte layout: data, padding to 4 bytes, one fp32 scale per block for
FP8), fixed when a group is built; :meth:`WireCodec.encode` / :meth:`WireCodec.decode` and the
collectives below execute it.

Why bytes: gloo has no FP8 collectives ("Invalid scalar type"), and FP8 data and its scales
must travel together; so each rank's contribution is one ``uint8`` record (data, then scales)
and every collective here moves ``uint8`` buffers. One record per peer, so an FP8 block never
straddles two ranks' chunks: scales are per rank-chunk.

* :func:`all_gather_records`: the FP8 parameter all-gather (each rank's quantized shard).
* :func:`reduce_scatter_lowp`: each rank encodes the chunk destined to each peer, one
  all-to-all moves the records, each rank decodes what it received and sums it in fp32 in rank
  order (0, 1, ...), so the result is deterministic and equal to a single-process sum of the
  decoded contributions in that order.
* :func:`all_reduce_lowp`: that reduce-scatter over the flattened tensors, then an all-gather
  of each rank's reduced chunk re-encoded; every rank decodes the same bytes (its own chunk
  included), so the replicas stay bit-identical.

FP8 quantization is ``hp_kernels.float8`` (``quantize_blockwise`` / ``dequantize_blockwise``)
and the all-reduce's flattening is ``hp_kernels.pack`` / ``unpack``, imported on first use:
FSDP without a low-precision policy never loads hp-kernels' extension.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch_async
from hp_fsdp._purpose import collective_purpose
from hp_fsdp.policy import FLOAT8_WIRE_DTYPES

__all__ = [
    "Deferred",
    "WireCodec",
    "all_gather_records",
    "all_reduce_lowp",
    "reduce_scatter_lowp",
    "sum_decoded",
]

_SCALE_DTYPE = torch.float32
_SCALE_BYTES = 4


@functools.cache
def _float8_format(dtype: torch.dtype) -> Any:
    """The ``hp_kernels.float8.Float8Format`` whose storage dtype is ``dtype``."""
    from hp_kernels.float8 import Float8Format

    for fmt in Float8Format:
        if fmt.dtype == dtype:
            return fmt
    raise ValueError(f"hp_kernels.float8 has no format for {dtype}")


@dataclass(frozen=True)
class WireCodec:
    """The byte record of one rank's contribution of ``numel`` elements.

    Attributes:
        dtype: the wire dtype: ``torch.bfloat16`` (a cast) or an FP8 dtype (block-scaled).
        numel: elements of the contribution.
        block_size: elements per fp32 scale (FP8 only).
    """

    dtype: torch.dtype
    numel: int
    block_size: int

    @property
    def is_float8(self) -> bool:
        """Block-scaled FP8 (data plus scales) rather than a plain cast."""
        return self.dtype in FLOAT8_WIRE_DTYPES

    @property
    def data_bytes(self) -> int:
        """Bytes of the encoded elements."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def blocks(self) -> int:
        """Scales in the record (0 for a plain cast)."""
        return -(-self.numel // self.block_size) if self.is_float8 else 0

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scales: the data padded to 4 bytes, so the scales (and the next
        rank's record) can be viewed as fp32 in place."""
        return -(-self.data_bytes // _SCALE_BYTES) * _SCALE_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of the record: what one rank contributes to the wire."""
        if not self.is_float8:
            return self.data_bytes
        return self.scale_offset + _SCALE_BYTES * self.blocks

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``x`` (1-d, ``numel`` elements, any float dtype) into ``out`` (``uint8``,
        ``nbytes``)."""
        data = out[: self.data_bytes].view(self.dtype)
        if not self.is_float8:
            data.copy_(x)
            return
        from hp_kernels.float8 import quantize_blockwise

        quantized, scales = quantize_blockwise(x, _float8_format(self.dtype), self.block_size)
        data.copy_(quantized)
        out[self.scale_offset : self.nbytes].view(_SCALE_DTYPE).copy_(scales)

    def decode(self, record: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The elements a record holds, in ``dtype`` (for a bf16 record in bf16, a view of it)."""
        data = record[: self.data_bytes].view(self.dtype)
        if not self.is_float8:
            return data.to(dtype)
        from hp_kernels.float8 import dequantize_blockwise

        scales = record[self.scale_offset : self.nbytes].view(_SCALE_DTYPE)
        out: torch.Tensor = dequantize_blockwise(data, scales, self.block_size, dtype)
        return out

    def encode_chunks(self, x: torch.Tensor, chunks: int) -> torch.Tensor:
        """``[chunks, nbytes]`` records of the ``chunks`` consecutive pieces of ``x``
        (``chunks * numel`` elements), one per destination rank."""
        out = torch.empty(chunks, self.nbytes, dtype=torch.uint8, device=x.device)
        for r in range(chunks):
            self.encode(x[r * self.numel : (r + 1) * self.numel], out[r])
        return out


class Deferred:
    """A collective's work handle and the local step that completes it (decode, sum), run by
    :meth:`wait` once: callers wait on it like on a ``torch.distributed.Work``. It also keeps
    the collective's buffers alive until then."""

    def __init__(self, work: Any, finish: Callable[[], None], *keep: torch.Tensor) -> None:
        self._work = work
        self._finish: Callable[[], None] | None = finish
        self._keep = keep

    def wait(self) -> bool:
        """Wait for the collective, then finish locally (idempotent)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self._keep = ()
        return True


def sum_decoded(codec: WireCodec, records: torch.Tensor, out: torch.Tensor) -> None:
    """``out = sum_r decode(records[r])``, accumulated in fp32 in rank order, then cast to
    ``out``'s dtype."""
    acc = codec.decode(records[0], torch.float32)
    if acc.data_ptr() == records.data_ptr():
        acc = acc.clone()  # a view of the receive buffer: do not accumulate into it
    for r in range(1, records.shape[0]):
        acc.add_(codec.decode(records[r], torch.float32))
    out.copy_(acc)


def all_gather_records(
    record: torch.Tensor, world: int, group: Any, purpose: str
) -> tuple[torch.Tensor, Any]:
    """Issue the all-gather of one ``uint8`` record per rank; ``([world, nbytes] output,
    async work)``."""
    out = torch.empty(world, record.numel(), dtype=torch.uint8, device=record.device)
    with collective_purpose(purpose):
        work = dist.all_gather_single(out.view(-1), record, group=group, async_op=True)
    return out, watch_async(f"all_gather (FSDP low-precision records, {purpose})", group, work)


def reduce_scatter_lowp(
    source: torch.Tensor,
    output: torch.Tensor,
    codec: WireCodec,
    world: int,
    group: Any,
    purpose: str = "grad_reduce_scatter",
) -> Deferred:
    """Reduce-scatter ``source`` (``world * codec.numel`` elements) into ``output`` (this
    rank's ``codec.numel``) with ``codec`` on the wire and an fp32 sum; asynchronous (the sum
    runs in :meth:`Deferred.wait`)."""
    send = codec.encode_chunks(source, world)
    recv = torch.empty_like(send)
    with collective_purpose(purpose):
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
    work = watch_async(f"all_to_all (FSDP low-precision reduce-scatter, {purpose})", group, work)
    return Deferred(work, lambda: sum_decoded(codec, recv, output), send, recv)


def all_reduce_lowp(
    tensors: Sequence[torch.Tensor],
    dtype: torch.dtype,
    block_size: int,
    world: int,
    group: Any,
    purpose: str = "grad_all_reduce",
) -> Deferred:
    """Sum ``tensors`` in place over ``group`` with ``dtype`` on the wire: a low-precision
    reduce-scatter of their concatenation (issued now), then, in :meth:`Deferred.wait`, an
    all-gather of the re-encoded reduced chunks, decoded back into ``tensors``."""
    from hp_kernels import pack, unpack

    total = sum(t.numel() for t in tensors)
    chunk = -(-total // world)
    flat = torch.zeros(world * chunk, dtype=torch.float32, device=tensors[0].device)
    offsets = list(itertools.accumulate((t.numel() for t in tensors[:-1]), initial=0))
    # One fused many-tensor copy with the cast to fp32 (hp-kernels' pack: C++/OpenMP on the
    # CPU, bit-equal to per-tensor copies).
    pack(tensors, flat, offsets)
    codec = WireCodec(dtype, chunk, block_size)
    reduced = torch.empty(chunk, dtype=torch.float32, device=flat.device)
    scatter = reduce_scatter_lowp(flat, reduced, codec, world, group, purpose)

    def finish() -> None:
        scatter.wait()
        record = torch.empty(codec.nbytes, dtype=torch.uint8, device=flat.device)
        codec.encode(reduced, record)
        gathered, work = all_gather_records(record, world, group, purpose)
        work.wait()
        for r in range(world):
            flat[r * chunk : (r + 1) * chunk].copy_(codec.decode(gathered[r], torch.float32))
        unpack(flat, offsets, tensors)

    return Deferred(None, finish)
