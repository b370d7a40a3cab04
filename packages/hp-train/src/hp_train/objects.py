"""Python objects over the job's default process group, each exchange watched by name
(:func:`hp_dtensor.watchdog.watch`), so that a rank that never joins one is named on a
timeout or a lost peer.

* :func:`gather_objects`: every rank's value, by rank;
* :func:`from_rank_0`: a value rank 0 computes, on every rank (what one rank reads from a
  shared file system, so that every rank acts on the same reading).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from hp_dtensor.watchdog import watch

__all__ = ["from_rank_0", "gather_objects"]

_T = TypeVar("_T")


def gather_objects(value: object, name: str) -> list[object]:
    """Every rank's ``value``, by rank (collective, watched as ``name``)."""
    gathered: list[object] = [None] * dist.get_world_size()
    with watch(name):
        dist.all_gather_object(gathered, value)
    return gathered


def from_rank_0(name: str, work: Callable[[], _T]) -> _T:
    """``work()`` on rank 0, its result broadcast to every rank (collective, watched as
    ``name``)."""
    box: list[object] = [work() if dist.get_rank() == 0 else None]
    with watch(name):
        dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]
