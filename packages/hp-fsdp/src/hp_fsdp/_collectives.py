"""The primitive that carries each of hp-fsdp's shard-axis collectives, chosen per backend.

A reduce-scatter can run as the backend's own (``reduce_scatter_single``) or as one all-to-all
of the chunks followed by a local sum: each rank receives every peer's copy of its own chunk
and adds them in rank order (0, 1, ...). Both give the same sum up to the order of the
additions (bit-equal at two ranks, where ``a + b == b + a``; tested). Which is better depends on
the backend, so the choice is a per-backend table, from ``benchmarks/collectives.py``'s
measurements and the memory bound, made once per group at its first reduce-scatter:

* gloo: the backend's own, for memory. The all-to-all is faster there (gloo's reduce-scatter
  is built on an all-reduce and moves about twice the bytes): measured by
  ``benchmarks/collectives.py`` on a 2-core AMD EPYC, fp32, one thread per rank, median of 15,
  at world 4 with 16 MiB of gradient per rank: native 47.8 ms, all-to-all 17.8 ms (2.7x); at
  world 2, 8 MiB: 17.5 ms and 8.5 ms. But it needs a receive buffer as large as the unsharded
  gradient while it runs, one block's gradient above torch FSDP2's peak memory, which
  hp-fsdp's default promises not to exceed (``tests/test_memory.py``). Choose it with
  ``HP_FSDP_REDUCE_SCATTER=all_to_all`` where memory allows.
* NCCL, HCCL and anything else: the backend's reduce-scatter (a ring that reduces in flight).

All-gathers stay the backend's own everywhere: on gloo an all-to-all all-gather needs the shard
repeated once per peer and was not faster at 4 MiB per rank (world 4: native 20.7 ms,
all-to-all 25.1 ms).

``HP_FSDP_REDUCE_SCATTER=native|all_to_all`` overrides the table, and so does
:func:`reduce_scatter_by` within a block.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from hp_fsdp._lowp_comm import Deferred

__all__ = [
    "ENV_VARIABLE",
    "ReduceScatterPrimitive",
    "reduce_scatter",
    "reduce_scatter_by",
    "reduce_scatter_primitive",
]

ENV_VARIABLE = "HP_FSDP_REDUCE_SCATTER"


class ReduceScatterPrimitive(enum.Enum):
    """How a reduce-scatter is carried.

    Attributes:
        NATIVE: the backend's ``reduce_scatter_single``.
        ALL_TO_ALL: ``all_to_all_single`` of the chunks, then a local sum in rank order.
    """

    NATIVE = "native"
    ALL_TO_ALL = "all_to_all"


# Backends whose default is not NATIVE (none today: see the module docstring for gloo).
_BY_BACKEND: dict[str, ReduceScatterPrimitive] = {}
_forced: list[ReduceScatterPrimitive] = []


@contextlib.contextmanager
def reduce_scatter_by(primitive: ReduceScatterPrimitive) -> Iterator[None]:
    """Groups whose first reduce-scatter runs inside this block use ``primitive`` (each group
    keeps the primitive of its first reduce-scatter)."""
    _forced.append(primitive)
    try:
        yield
    finally:
        _forced.pop()


def reduce_scatter_primitive(group: Any) -> ReduceScatterPrimitive:
    """The primitive for reduce-scatters over ``group`` (the table above, or the override).

    Raises:
        ValueError: ``HP_FSDP_REDUCE_SCATTER`` names no primitive.
    """
    if _forced:
        return _forced[-1]
    forced = os.environ.get(ENV_VARIABLE, "")
    if forced:
        try:
            return ReduceScatterPrimitive(forced)
        except ValueError:
            choices = [p.value for p in ReduceScatterPrimitive]
            raise ValueError(f"{ENV_VARIABLE}={forced!r}: use one of {choices}") from None
    backend = str(dist.get_backend(group)).lower()
    return _BY_BACKEND.get(backend, ReduceScatterPrimitive.NATIVE)


def reduce_scatter(
    output: torch.Tensor,
    source: torch.Tensor,
    group: Any,
    world: int,
    primitive: ReduceScatterPrimitive,
) -> Any:
    """Start ``output = sum over ranks of source.view(world, -1)[rank]``; returns a handle to
    ``wait`` on (the local sum of the all-to-all runs in its ``wait``)."""
    if primitive is ReduceScatterPrimitive.NATIVE:
        return dist.reduce_scatter_single(output, source, group=group, async_op=True)
    received = torch.empty_like(source)
    work = dist.all_to_all_single(received, source, group=group, async_op=True)

    def add_in_rank_order() -> None:
        torch.sum(received.view(world, -1), dim=0, out=output)

    return Deferred(work, add_in_rank_order, received, source)
