"""The primitive that carries each of hp-fsdp's shard-axis collectives, chosen per backend.

A reduce-scatter can run as the backend's own (``reduce_scatter_single``) or as one all-to-all
of the chunks followed by a local sum in a fixed order: each rank receives every peer's copy of
its own chunk and adds them in rank order, ``((c0 + c1) + c2) + ...`` (one elementwise add per
peer, in the reduce dtype). The result depends only on the contributions, never on which
arrived first: it is bitwise reproducible from run to run, and anyone can recompute it (the
tests do, from every rank's unreduced gradient). Which primitive is better depends on the
backend, so the choice is a per-backend table, from ``benchmarks/collectives.py``'s and
``benchmarks/fsdp_step.py``'s measurements and the memory bound, made once per group at its
first reduce-scatter:

* gloo, every group size: the all-to-all. gloo's reduce-scatter is built on an all-reduce and
  moves about twice the bytes: measured by ``benchmarks/collectives.py`` on a 2-core AMD EPYC,
  fp32, one thread per rank, median of 15: world 2, 8 MiB of gradient per rank, native
  17.5 ms, all-to-all 8.5 ms; world 4, 16 MiB per rank, native 47.8 ms, all-to-all 17.8 ms.
  A rank whose own chunk is the first or the last (both ranks of a pair, the two end ranks of a
  larger group) sends the rest of the gradient, one contiguous run, and receives only its
  peers' copies: its receive buffer is ``(world - 1) / world`` of the unsharded gradient and its
  own chunk is never copied; the other ranks exchange the whole gradient, their own chunk
  included. Over a pair, the one row received is the output itself (``c1 + c0 == c0 + c1``
  bit for bit): no receive buffer. The group's unsharded parameters are freed before the buffer is
  allocated, so the step's peak stays at or below torch FSDP2's (``tests/test_memory.py``).
  Over two ranks the sums are bit-equal to gloo's own
  (``a + b == b + a``); over more, gloo's ring adds in another order, so the two differ by
  rounding (after 5 AdamW steps at world 4, 1.3e-5 of each tensor's largest entry): tests that
  compare with torch FSDP2 at a tighter bound pin the native primitive.
* NCCL, HCCL and anything else: the backend's reduce-scatter (a ring that reduces in flight).

All-gathers (:func:`all_gather`) are the backend's own, but for a pair of ranks on gloo. gloo's
all-gather gathers into a buffer of its own, allocated per call, and then copies the whole of it
into the output; over a pair, each rank instead sends its shard to its peer through an all-to-all
whose rows all go to the peer, receives the peer's shard straight into its slice of the output,
and copies its own shard into its own slice: half the bytes copied and no buffer allocated
(fp32, median of 41 alternating calls on a 2-core EPYC, one thread per rank, the machine busy
with a test run: 1.0 MiB shards 2.62 ms native, 1.40 ms exchanged; 1.5 MiB 4.01 and 2.86 ms;
6.1 MiB 11.4 and 9.2 ms). Over more ranks an all-to-all all-gather needs the shard repeated
once per peer and was not faster at 4 MiB per rank (world 4: native 20.7 ms, all-to-all
25.1 ms).

``HP_FSDP_REDUCE_SCATTER=native|all_to_all`` overrides the table, and so does
:func:`reduce_scatter_by` within a block.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch_async
from hp_fsdp._lowp_comm import Deferred

__all__ = [
    "ENV_VARIABLE",
    "ReduceScatterPrimitive",
    "add_in_rank_order",
    "all_gather",
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


# Backends whose default is not NATIVE (see the module docstring).
_BY_BACKEND: dict[str, ReduceScatterPrimitive] = {"gloo": ReduceScatterPrimitive.ALL_TO_ALL}
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
    """The primitive for reduce-scatters over ``group``: the table above (by backend), or the
    override.

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
    ``wait`` on (the all-to-all's local sum, :func:`add_in_rank_order`, runs in its ``wait``)."""
    if primitive is ReduceScatterPrimitive.NATIVE:
        return watch_async(
            "reduce_scatter (FSDP gradients)",
            group,
            dist.reduce_scatter_single(output, source, group=group, async_op=True),
        )
    me = dist.get_rank(group)
    chunks = source.view(world, -1)
    # The own chunk at an end stays out of the exchange: the rest is one contiguous run.
    at_end = me in (0, world - 1)
    send = (chunks[1:] if me == 0 else chunks[:-1]) if at_end else chunks
    splits = [0 if r == me else 1 for r in range(world)] if at_end else None  # rows of send
    if world == 2 and output.dtype == source.dtype and output.is_contiguous():
        # The peer's one row lands in the output itself: c0 + c1 == c1 + c0 bit for bit, so
        # the sum is the same and no receive buffer is held while the exchange is in flight.
        received = output.view(1, -1)
    else:
        received = torch.empty_like(send)
    work = _exchange("FSDP gradient reduce-scatter", received, send, splits, group)
    rows = list(received)
    if at_end:
        rows.insert(me, chunks[me])
    return Deferred(work, lambda: add_in_rank_order(rows, output), received, source)


# Backends whose all-gather over a pair of ranks is an exchange (see the module docstring).
_PAIR_EXCHANGE_BACKENDS = frozenset({"gloo"})


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any, world: int) -> Any:
    """Start ``output = every rank's shard, in rank order``; returns a handle to ``wait`` on
    (``shard`` must stay alive until then). Over a pair of ranks on gloo, an exchange (module
    docstring); the backend's all-gather otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if world != 2 or backend not in _PAIR_EXCHANGE_BACKENDS:
        return watch_async(
            "all_gather (FSDP parameters)",
            group,
            dist.all_gather_single(output, shard, group=group, async_op=True),
        )
    me = dist.get_rank(group)
    n = shard.numel()
    splits = [0, n] if me == 0 else [n, 0]  # rows of shard and of the peer's slice
    peer_slice = output[n:] if me == 0 else output[:n]
    work = _exchange("FSDP parameter all-gather", peer_slice, shard, splits, group)
    output[me * n : (me + 1) * n].copy_(shard)
    return work


def _exchange(
    what: str,
    received: torch.Tensor,
    send: torch.Tensor,
    splits: list[int] | None,
    group: Any,
) -> Any:
    """Start the watched ``all_to_all_single`` behind ``what``, the same split sizes (rows)
    sent and received (None: an even split)."""
    return watch_async(
        f"all_to_all ({what})",
        group,
        dist.all_to_all_single(
            received, send, output_split_sizes=splits, input_split_sizes=splits,
            group=group, async_op=True,
        ),
    )  # fmt: skip


def add_in_rank_order(rows: Sequence[torch.Tensor], output: torch.Tensor) -> None:
    """``output = ((rows[0] + rows[1]) + rows[2]) + ...``, one rounding per add in ``output``'s
    dtype. Spelled out rather than ``torch.sum(rows, 0)``, whose order of additions depends on
    the kernel (it differs from this one at 5 rows of fp32, and at 3 rows of bf16, which it
    accumulates in fp32)."""
    if len(rows) == 1:
        output.copy_(rows[0])
        return
    torch.add(rows[0], rows[1], out=output)
    for row in rows[2:]:
        output.add_(row)
