"""The gradient arena: every group's reduced gradient chunk in one buffer, so the slow-tier
all-reduce of HSDP runs on contiguous slices covering several groups (no copy), bucketed and
asynchronous, and is waited for once at the end of backward.

Buckets are runs of groups in backward order whose chunks add up to ``bucket_bytes``; a bucket's
all-reduce is issued as soon as the reduce-scatters of all its groups are in, so the slow link
works while the backward of earlier layers runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradArena"]


@dataclass
class _Entry:
    """One group in the arena."""

    offset: int
    numel: int
    bucket: int
    work: Any = None
    release: Callable[[], None] | None = None
    accumulate: torch.Tensor | None = None
    submitted: bool = False


@dataclass
class _Bucket:
    start: int
    stop: int
    members: list[int] = field(default_factory=list)
    work: Any = None
    fired: bool = False


class GradArena:
    """Reduced gradient chunks of ``sizes`` groups (given in backward order)."""

    def __init__(
        self,
        sizes: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        shard_size: int,
        replicate_group: Any,
        replicate_size: int,
        bucket_bytes: int,
    ) -> None:
        self.buffer = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self.shard_size = shard_size
        self.replicate_group = replicate_group
        self.replicate_size = replicate_size
        self.entries: list[_Entry] = []
        self.buckets: list[_Bucket] = []
        itemsize = self.buffer.element_size()
        offset = 0
        for index, numel in enumerate(sizes):
            if (
                not self.buckets
                or (self.buckets[-1].stop - self.buckets[-1].start) * itemsize >= bucket_bytes
            ):
                self.buckets.append(_Bucket(offset, offset))
            bucket = self.buckets[-1]
            bucket.members.append(index)
            bucket.stop = offset + numel
            self.entries.append(_Entry(offset, numel, len(self.buckets) - 1))
            offset += numel
        self.slow_collectives = 0

    def chunk(self, index: int) -> torch.Tensor:
        """Group ``index``'s reduced gradient chunk."""
        entry = self.entries[index]
        return self.buffer[entry.offset : entry.offset + entry.numel]

    def submit(
        self,
        index: int,
        work: Any,
        release: Callable[[], None],
        accumulate: torch.Tensor | None = None,
    ) -> None:
        """Group ``index``'s reduce-scatter was issued (``work``); ``release`` frees its input
        once done. With ``accumulate`` the reduce-scatter wrote there, to be added on top."""
        entry = self.entries[index]
        entry.work, entry.release, entry.accumulate, entry.submitted = (
            work,
            release,
            accumulate,
            True,
        )
        bucket = self.buckets[entry.bucket]
        if all(self.entries[i].submitted for i in bucket.members):
            self._fire(bucket)

    def _complete(self, entry: _Entry) -> None:
        if entry.work is not None:
            entry.work.wait()
            entry.work = None
        if entry.release is not None:
            entry.release()
            entry.release = None

    def _fire(self, bucket: _Bucket) -> None:
        if bucket.fired:
            return
        bucket.fired = True
        for i in bucket.members:
            entry = self.entries[i]
            if not entry.submitted:
                continue
            self._complete(entry)
        if self.replicate_size > 1 and bucket.stop > bucket.start:
            accumulating = [
                self.entries[i] for i in bucket.members if self.entries[i].accumulate is not None
            ]
            if accumulating:
                # Previous gradients already live in the arena: reduce only the new ones.
                for entry in accumulating:
                    assert entry.accumulate is not None
                    dist.all_reduce(entry.accumulate, group=self.replicate_group)
                    self.slow_collectives += 1
            plain = [self.entries[i] for i in bucket.members if self.entries[i].accumulate is None]
            if plain and not accumulating:
                region = self.buffer[bucket.start : bucket.stop]
                bucket.work = dist.all_reduce(region, group=self.replicate_group, async_op=True)
                self.slow_collectives += 1
            elif plain:
                for entry in plain:
                    region = self.buffer[entry.offset : entry.offset + entry.numel]
                    dist.all_reduce(region, group=self.replicate_group)
                    self.slow_collectives += 1

    def finish(self, divide_factor: float | None = None) -> list[int]:
        """Fire what is left, wait for everything, divide by ``divide_factor`` (default: the
        number of data-parallel ranks, i.e. average); the indices that took part."""
        for bucket in self.buckets:
            if any(self.entries[i].submitted for i in bucket.members):
                self._fire(bucket)
        done: list[int] = []
        factor = divide_factor or float(self.shard_size * self.replicate_size)
        scale = 1.0 / factor
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            for i in bucket.members:
                entry = self.entries[i]
                if not entry.submitted:
                    continue
                region = self.buffer[entry.offset : entry.offset + entry.numel]
                if entry.accumulate is not None:
                    region.add_(entry.accumulate, alpha=scale)
                else:
                    region.mul_(scale)
                done.append(i)
            bucket.fired = False
        for entry in self.entries:
            entry.submitted = False
            entry.accumulate = None
        return done
