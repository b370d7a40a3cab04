"""Flat-buffer pack/unpack: many tensors into one 1-D buffer and back, with dtype casts.

What FSDP buckets need where a copy is unavoidable (a mixed-precision cast, an all-gather
input assembled from parameters). ``pack`` writes ``tensors[i]`` flattened and cast to
``out.dtype`` into ``out[offsets[i]:offsets[i] + tensors[i].numel()]``; ``unpack`` is the
inverse into given tensors. Both have ``copy_`` semantics (round-to-nearest-even casts), and
every backend is bit-equal to the reference for finite and infinite values (a NaN stays a NaN;
its payload bits may differ, as they do between ATen's own vectorized and scalar paths).

Registered as ``torch.ops.hp_kernels.pack`` / ``unpack`` with fake implementations, so they
trace under FakeTensorMode and ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hp_kernels.reference as reference
from hp_kernels._checks import check_flat_layout
from hp_kernels.backends import (
    Native,
    cpu_extension_missing,
    pick,
    torch_npu_missing,
    triton_missing,
)

__all__ = ["offsets_of", "pack", "unpack"]


def _cpu_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    torch.ops.hp_kernels_cpu.pack(list(tensors), out, list(offsets))


def _cpu_unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    torch.ops.hp_kernels_cpu.unpack(flat, list(offsets), list(outs))


def _cuda_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    from hp_kernels import triton_kernels

    triton_kernels.copy_pairs(
        list(tensors),
        [out.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(tensors, offsets, strict=True)],
    )


def _cuda_unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    from hp_kernels import triton_kernels

    triton_kernels.copy_pairs(
        [flat.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(outs, offsets, strict=True)],
        list(outs),
    )


def _npu_pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    # torch_npu implements the foreach ops as one multi-tensor kernel; importing torch_npu
    # registers the device, which must happen before npu tensors exist, so it is imported here.
    import torch_npu  # noqa: F401

    dsts = [
        out.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(tensors, offsets, strict=True)
    ]
    torch._foreach_copy_(dsts, list(tensors))


def _npu_unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    import torch_npu  # noqa: F401

    srcs = [flat.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(outs, offsets, strict=True)]
    torch._foreach_copy_(list(outs), srcs)


_PACK = {
    "cpu": Native("cpp-extension", cpu_extension_missing, _cpu_pack),
    "cuda": Native("triton", triton_missing, _cuda_pack),
    "npu": Native("torch_npu", torch_npu_missing, _npu_pack),
}
_UNPACK = {
    "cpu": Native("cpp-extension", cpu_extension_missing, _cpu_unpack),
    "cuda": Native("triton", triton_missing, _cuda_unpack),
    "npu": Native("torch_npu", torch_npu_missing, _npu_unpack),
}


@torch.library.custom_op("hp_kernels::pack", mutates_args=("out",))
def _pack_op(tensors: list[torch.Tensor], out: torch.Tensor, offsets: list[int]) -> None:
    check_flat_layout("pack", out, offsets, tensors, "out", "tensors")
    kernel = pick("pack", out.device.type, _PACK)
    (kernel or reference.pack)(tensors, out, offsets)


@_pack_op.register_fake
def _pack_fake(tensors: list[torch.Tensor], out: torch.Tensor, offsets: list[int]) -> None:
    check_flat_layout("pack", out, offsets, tensors, "out", "tensors")


@torch.library.custom_op("hp_kernels::unpack", mutates_args=("outs",))
def _unpack_op(flat: torch.Tensor, offsets: list[int], outs: list[torch.Tensor]) -> None:
    check_flat_layout("unpack", flat, offsets, outs, "flat", "outs")
    kernel = pick("unpack", flat.device.type, _UNPACK)
    (kernel or reference.unpack)(flat, offsets, outs)


@_unpack_op.register_fake
def _unpack_fake(flat: torch.Tensor, offsets: list[int], outs: list[torch.Tensor]) -> None:
    check_flat_layout("unpack", flat, offsets, outs, "flat", "outs")


def pack(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]
) -> torch.Tensor:
    """Copy each of ``tensors``, flattened and cast to ``out.dtype``, into ``out`` at its offset.

    Args:
        tensors: any shapes, dtypes and strides (non-contiguous ones are read as they are).
        out: a contiguous 1-D buffer on the tensors' device.
        offsets: one element offset per tensor; ranges must lie in ``out`` and not overlap
            (gaps are allowed and left untouched; empty tensors are skipped).

    Returns:
        ``out``.

    Raises:
        ValueError: counts differ, a range does not fit or two ranges overlap, devices differ.
    """
    torch.ops.hp_kernels.pack(list(tensors), out, [int(o) for o in offsets])
    return out


def unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy ``flat[offsets[i]:offsets[i] + outs[i].numel()]``, cast, into each ``outs[i]``.

    The inverse of :func:`pack`; ``outs`` may be non-contiguous views. Raises ValueError like
    :func:`pack`.
    """
    torch.ops.hp_kernels.unpack(flat, [int(o) for o in offsets], list(outs))


def offsets_of(tensors: Sequence[torch.Tensor], align: int = 1) -> tuple[list[int], int]:
    """Dense offsets for ``tensors`` (each start rounded up to a multiple of ``align``
    elements) and the buffer size they need."""
    if align < 1:
        raise ValueError(f"align must be a positive number of elements, got {align}")
    offsets: list[int] = []
    end = 0
    for t in tensors:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + t.numel()
    return offsets, end
