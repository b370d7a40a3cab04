"""Where reduced gradient chunks go, and the fused slow-tier reduction of HSDP.

Each group's reduce-scatter writes this rank's chunk into a fresh buffer, allocated when the
reduce-scatter is issued (memory grows group by group, as in FSDP2) and handed over to the
sharded parameters' gradients at the end of backward (the arena keeps no reference: dropping
the gradients frees it). A reduce-scatter is completed (and its large unsharded input freed)
at once, or, when held (:mod:`hp_fsdp.reduce_overlap`), by :meth:`GradArena.drain` when the
next group's reduction starts, or at the end of backward: at most one is in flight.

For HSDP, groups form buckets (runs in backward order, cut by
:func:`hp_fsdp.replicate_buckets.plan_replicate_buckets` from the slow tier's cost); as soon as
the reduce-scatters of all groups of a bucket are complete, ONE asynchronous all-reduce over the
replicate (slow) axis is issued for all their chunks (a coalesced collective: NCCL groups it, gloo
flattens it internally), so the slow link works while the backward of earlier layers runs. All
of them are waited for once, at the end of backward.

Gradient accumulation under HSDP (``FSDPModule.set_requires_all_reduce(False)`` on the
micro-steps before the last): each micro-step still reduce-scatters over the shard axis (the
unsharded gradients are freed every time), but a group whose state skips the all-reduce keeps
its reduced chunk here as a *pending* sum instead of handing it to the gradients; the next
backward that all-reduces adds the pending sum into its chunk first, so the slow link carries
one all-reduce per optimizer step. The pending chunk is this rank's, summed over the shard axis
and over the micro-steps, not yet divided. With a low-precision replicate wire dtype
(``LowPrecisionCommPolicy.replicate_reduce_dtype``) the bucket's all-reduce is
``_lowp_comm.all_reduce_lowp``: its reduce-scatter part is issued then, its all-gather part when
it is waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager as coalescing_manager

from hp_dtensor.watchdog import watch_async
from hp_fsdp._lowp_comm import all_reduce_lowp
from hp_fsdp._purpose import collective_purpose

__all__ = ["GradArena", "Reduced"]


@dataclass
class _Entry:
    """One group."""

    bucket: int
    numel: int
    chunk: torch.Tensor | None = None
    work: Any = None
    release: Callable[[], None] | None = None
    accumulate: torch.Tensor | None = None
    submitted: bool = False
    completed: bool = False
    all_reduce: bool = True
    pending: torch.Tensor | None = None


@dataclass
class _Bucket:
    members: list[int] = field(default_factory=list)
    numel: int = 0
    work: Any = None
    fired: bool = False


@dataclass(frozen=True)
class Reduced:
    """A group's averaged gradient chunk after backward.

    Attributes:
        index: the group (in backward order).
        chunk: this rank's chunk; a fresh buffer's view, or, when ``accumulate``, the new
            gradients to add onto the existing ones.
        accumulate: the sharded parameters already had gradients: add ``chunk`` to them.
    """

    index: int
    chunk: torch.Tensor
    accumulate: bool


class GradArena:
    """Reduced gradient chunks of groups of ``sizes`` elements (given in backward order).

    ``buckets``: runs of group indices, in order, each all-reduced over the replicate axis as
    one collective (:mod:`hp_fsdp.replicate_buckets`; unused without a replicate axis).
    ``replicate_wire``: ``(wire dtype, block size)`` of the replicate-axis all-reduce when it
    is low precision (bf16 or FP8), None for the backend's all-reduce in ``dtype``.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        shard_size: int,
        replicate_group: Any,
        replicate_size: int,
        buckets: Sequence[Sequence[int]],
        replicate_wire: tuple[torch.dtype, int] | None = None,
    ) -> None:
        self.dtype = dtype
        self.replicate_wire = replicate_wire
        self.device = device
        self.shard_size = shard_size
        self.replicate_group = replicate_group
        self.replicate_size = replicate_size
        # A plan that skipped or repeated a group would leave its chunk unreduced or reduce it
        # twice: refused here, not found in the gradients.
        covered = [index for bucket in buckets for index in bucket]
        if covered != list(range(len(sizes))):
            raise ValueError(
                f"buckets {list(map(list, buckets))} must cover the {len(sizes)} groups once, "
                "in order"
            )
        self.entries: list[_Entry] = []
        self.buckets: list[_Bucket] = []
        for bucket_index, members in enumerate(buckets):
            self.buckets.append(_Bucket(list(members), sum(sizes[i] for i in members)))
            self.entries += [_Entry(bucket_index, sizes[i]) for i in members]
        self.slow_collectives = 0
        self._in_flight: list[_Entry] = []

    def chunk(self, index: int) -> torch.Tensor:
        """Group ``index``'s chunk for this backward (allocated on first use)."""
        entry = self.entries[index]
        if entry.chunk is None:
            entry.chunk = torch.empty(entry.numel, dtype=self.dtype, device=self.device)
        return entry.chunk

    def submit(
        self,
        index: int,
        work: Any,
        release: Callable[[], None],
        accumulate: torch.Tensor | None = None,
        all_reduce: bool = True,
        hold: bool = False,
    ) -> None:
        """Group ``index``'s reduce-scatter was issued (``work``) into its chunk, or into
        ``accumulate`` when its sharded parameters already have gradients; ``release`` frees
        the reduce-scatter's input once it is done. ``all_reduce=False`` (HSDP gradient
        accumulation) keeps the result pending instead of reducing it over the replicate axis
        and handing it over. ``hold`` leaves it in flight until :meth:`drain` (the next group's
        reduction) or :meth:`finish` (:mod:`hp_fsdp.reduce_overlap`); else it is completed
        now. A reduce-scatter still in flight from an earlier group is completed first."""
        self.drain()
        entry = self.entries[index]
        entry.work, entry.release, entry.accumulate = work, release, accumulate
        entry.all_reduce = all_reduce or self.replicate_size == 1
        entry.submitted = True
        if hold:
            self._in_flight = [entry]
        else:
            self._complete(entry)

    @property
    def reduced(self) -> int:
        """How many groups were submitted in this backward."""
        return sum(entry.submitted for entry in self.entries)

    def drain(self) -> None:
        """Complete the reduce-scatter left in flight, if any (freeing its unsharded input),
        and start its bucket's all-reduce if that completes the bucket."""
        in_flight, self._in_flight = self._in_flight, []
        for entry in in_flight:
            self._complete(entry)

    def _complete(self, entry: _Entry) -> None:
        if entry.work is not None:
            entry.work.wait()
            entry.work = None
        if entry.release is not None:
            entry.release()
            entry.release = None
        entry.completed = True
        bucket = self.buckets[entry.bucket]
        if all(self.entries[i].completed for i in bucket.members):
            self._fire(bucket)

    def _fire(self, bucket: _Bucket) -> None:
        """Start the replicate-axis all-reduce of ``bucket``'s submitted groups, all completed
        (once per backward; nothing without a replicate axis)."""
        if bucket.fired:
            return
        bucket.fired = True
        members = [self.entries[i] for i in bucket.members if self.entries[i].submitted]
        members = [e for e in members if e.all_reduce]
        if self.replicate_size == 1 or not members:
            return
        targets = [e.accumulate if e.accumulate is not None else e.chunk for e in members]
        for entry, target in zip(members, targets, strict=True):
            if entry.pending is not None:
                assert target is not None
                target.add_(entry.pending)
                entry.pending = None
        if self.replicate_wire is not None:
            wire, block = self.replicate_wire
            present = [t for t in targets if t is not None]
            bucket.work = all_reduce_lowp(
                present, wire, block, self.replicate_size, self.replicate_group
            )
            self.slow_collectives += 1
            return
        with (
            collective_purpose("grad_all_reduce"),
            coalescing_manager(group=self.replicate_group, async_ops=True) as fused,
        ):
            for target in targets:
                assert target is not None
                dist.all_reduce(target, group=self.replicate_group)  # watched: coalesced below
        bucket.work = watch_async("all_reduce (HSDP gradients)", self.replicate_group, fused)
        self.slow_collectives += 1

    def finish(self, divide_factor: float | None = None) -> list[Reduced]:
        """Fire what is left, wait for everything, divide by ``divide_factor`` (default: the
        number of data-parallel ranks, i.e. average), and hand the chunks over (all but the
        pending ones, see :meth:`submit`)."""
        self.drain()
        for bucket in self.buckets:
            if any(self.entries[i].submitted for i in bucket.members):
                self._fire(bucket)
        scale = 1.0 / (divide_factor or float(self.shard_size * self.replicate_size))
        out: list[Reduced] = []
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            for i in bucket.members:
                entry = self.entries[i]
                if not entry.submitted:
                    continue
                if not entry.all_reduce:
                    result = entry.accumulate if entry.accumulate is not None else entry.chunk
                    assert result is not None
                    entry.pending = result if entry.pending is None else entry.pending.add_(result)
                elif entry.accumulate is not None:
                    out.append(Reduced(i, entry.accumulate.mul_(scale), True))
                else:
                    assert entry.chunk is not None
                    out.append(Reduced(i, entry.chunk.mul_(scale), False))
                # The gradients own the chunk now; zero_grad frees it.
                entry.chunk = None
                entry.submitted = entry.completed = False
                entry.accumulate = None
            bucket.fired = False
        return out
