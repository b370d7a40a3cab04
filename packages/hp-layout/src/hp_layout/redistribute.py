"""Redistribution planning: the steps that turn one layout's shards into another's.

:func:`plan_redistribute` returns an immutable :class:`RedistributePlan`: a tuple of
:class:`Step`, each one collective (or one local operation) along one mesh axis. Executors
(the numpy reference in :mod:`hp_layout.reference`, the torch one in hp-dtensor) run the steps
in order; planning never touches data.

The planner searches the layouts reachable by single-axis steps for the cheapest path, where
cost is the number of elements received on the slowest tier first, then on each faster tier,
then the number of steps. Elements are counted exactly (uneven shards included) as the sum
over all ranks of what each receives. Because the naive path -- reduce every pending partial,
gather every shard, slice the destination -- is one of the paths searched, a plan never moves
more than :func:`plan_gather_then_slice`.

Every tensor dim may be sharded along the way, also one that neither ``src`` nor ``dst``
shards: hierarchical collectives (reduce-scatter over one axis, all-reduce the pieces over
another, all-gather again) come out of the search that way. They pay off on one tier too: two
partial axes of 2 ranks reduced this way receive 3/4 of what two all-reduces do.

Which steps are legal: a step may only undo the innermost sharding of a tensor dimension (the
axis applied last on it), and new shards always become innermost; a ``RaggedShard`` is always
applied last, so while one exists only it and pending reductions may change. A ``Partial``
destination can only come from ``Replicate`` (a local partition) or the same ``Partial`` on
that axis.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from hp_layout.chunking import chunk_length
from hp_layout.errors import PlacementError, RedistributionError
from hp_layout.layout import Layout
from hp_layout.placement import Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard
from hp_layout.topology import Collective, Topology

__all__ = [
    "RedistributePlan",
    "Step",
    "StepKind",
    "plan_gather_then_slice",
    "plan_redistribute",
]


class StepKind(enum.Enum):
    """What one step does along its mesh axis."""

    LOCAL_SLICE = "local_slice"
    """Replicate -> Shard or RaggedShard: keep this rank's piece; no communication."""
    LOCAL_PARTITION = "local_partition"
    """Replicate -> Partial(op): local values become partial ones (sum: coordinate 0 keeps
    the value, the others hold zeros; avg, max, min: every rank keeps the value)."""
    ALL_GATHER = "all_gather"
    """Shard or RaggedShard -> Replicate: concatenate the group's pieces in coordinate order."""
    REDUCE_SCATTER = "reduce_scatter"
    """Partial(op) -> Shard or RaggedShard: reduce over the group, keep this rank's piece."""
    ALL_REDUCE = "all_reduce"
    """Partial(op) -> Replicate: reduce over the group."""
    ALL_TO_ALL = "all_to_all"
    """Shard(a) -> Shard(b): send piece j of dim b to coordinate j, concatenate along a."""

    @property
    def collective(self) -> Collective | None:
        """The collective the step runs, or None for a local step."""
        return _COLLECTIVE_OF.get(self)


_COLLECTIVE_OF = {
    StepKind.ALL_GATHER: Collective.ALL_GATHER,
    StepKind.REDUCE_SCATTER: Collective.REDUCE_SCATTER,
    StepKind.ALL_REDUCE: Collective.ALL_REDUCE,
    StepKind.ALL_TO_ALL: Collective.ALL_TO_ALL,
}


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``kind`` along mesh axis ``axis``, from ``before`` to ``after``.

    Attributes:
        kind: what the step does.
        axis: the mesh axis whose groups run the step; ``before`` and ``after`` differ on
            this axis only.
        before: the layout the step starts from.
        after: the layout the step produces.
        elements: elements received, summed over all ranks (0 for local steps).
    """

    kind: StepKind
    axis: str
    before: Layout
    after: Layout
    elements: int

    @property
    def src_placement(self) -> Placement:
        """Placement on ``axis`` before the step."""
        return self.before.placement(self.axis)

    @property
    def dst_placement(self) -> Placement:
        """Placement on ``axis`` after the step."""
        return self.after.placement(self.axis)

    @property
    def group_size(self) -> int:
        """Ranks in each group along ``axis``."""
        return self.before.mesh.axis_size(self.axis)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The rank groups (ordered by coordinate along ``axis``) that run the step."""
        return self.before.mesh.groups(self.axis)

    @property
    def gather_dim(self) -> int | None:
        """Tensor dim concatenated (all-gather, all-to-all); None for ragged or other steps."""
        p = self.src_placement
        return p.dim if isinstance(p, Shard) else None

    @property
    def scatter_dim(self) -> int | None:
        """Tensor dim split (slice, reduce-scatter, all-to-all); None for ragged or others."""
        p = self.dst_placement
        return p.dim if isinstance(p, Shard) else None

    @property
    def reduce_op(self) -> ReduceOp | None:
        """The reduction of a reduce-scatter or all-reduce, or the partition's op."""
        for p in (self.src_placement, self.dst_placement):
            if isinstance(p, Partial):
                return p.op
        return None

    def nbytes(self, itemsize: int) -> int:
        """Bytes received over all ranks for elements of ``itemsize`` bytes."""
        return self.elements * itemsize

    def __str__(self) -> str:
        return (
            f"{self.kind.value} over {self.axis!r} ({self.group_size} ranks): "
            f"{self.src_placement!r} -> {self.dst_placement!r}, {self.elements} elements"
        )


@dataclass(frozen=True)
class RedistributePlan:
    """An immutable sequence of steps that turns ``src`` shards into ``dst`` shards.

    Attributes:
        src: the starting layout.
        dst: the final layout (the last step's ``after``, or ``src`` when no step is needed).
        steps: the steps, in execution order.
    """

    src: Layout
    dst: Layout
    steps: tuple[Step, ...]

    @property
    def elements_moved(self) -> int:
        """Elements received over all ranks and steps."""
        return sum(s.elements for s in self.steps)

    def bytes_moved(self, itemsize: int) -> int:
        """Bytes received over all ranks and steps for elements of ``itemsize`` bytes."""
        return self.elements_moved * itemsize

    def bytes_by_tier(self, topology: Topology, itemsize: int) -> dict[str, int]:
        """Bytes received over all ranks, per tier of ``topology`` (every tier listed)."""
        out = {t.name: 0 for t in topology.tiers}
        for s in self.steps:
            if s.elements:
                out[topology.axis_tier(s.before.mesh, s.axis).name] += s.nbytes(itemsize)
        return out

    def estimated_time(self, topology: Topology, itemsize: int) -> float:
        """Alpha-beta estimate (s) of running the steps one after another on ``topology``.

        Each collective is costed with the mean per-rank buffer (exact for even shards).
        """
        world = self.src.mesh.size
        total = 0.0
        for s in self.steps:
            kind = s.kind.collective
            if kind is None:
                continue
            side = s.after if kind is Collective.ALL_GATHER else s.before
            nbytes = side.total_local_numel() * itemsize / world
            tier = topology.axis_tier(s.before.mesh, s.axis)
            total += topology.collective_time(kind, s.group_size, nbytes, tier)
        return total

    def __str__(self) -> str:
        head = f"plan {self.src!r} -> {self.dst!r}"
        if not self.steps:
            return head + ": no steps"
        return head + "".join(f"\n  {i}. {s}" for i, s in enumerate(self.steps))


# Element accounting ---------------------------------------------------------------------------


def _all_to_all_kept(before: Layout, after: Layout, axis: int) -> int:
    """Sum over ranks of the elements an all-to-all on ``axis`` leaves in place.

    Let the all-to-all move ``axis`` from sharding dim ``d1`` to dim ``d2``. Along ``d1`` a
    rank's old extent is piece ``c`` (its coordinate on ``axis``) of the new one; along
    ``d2`` its new extent is piece ``c`` of the old one; every other dim keeps its extent, and
    the shards of those dims tile the tensor. So the kept elements factorize per ``c`` into
    sums over the distinct extents of the parents of ``d1`` and ``d2``.
    """
    src = before.placements[axis]
    dst = after.placements[axis]
    assert isinstance(src, Shard)
    assert isinstance(dst, Shard)
    mesh = before.mesh
    p = mesh.shape[axis]
    parents_d1 = after.dim_length_counts(src.dim)
    parents_d2 = before.dim_length_counts(dst.dim)

    def piece_sum(parents: dict[int, int], c: int) -> int:
        return sum(count * chunk_length(n, p, c) for n, count in parents.items())

    kept = sum(piece_sum(parents_d1, c) * piece_sum(parents_d2, c) for c in range(p))
    others = math.prod(n for d, n in enumerate(before.global_shape) if d not in (src.dim, dst.dim))
    free = math.prod(
        size
        for size, q in zip(mesh.shape, before.placements, strict=True)
        if isinstance(q, Replicate | Partial)
    )
    return kept * others * free


def _elements(kind: StepKind, before: Layout, after: Layout, axis: int) -> int:
    if kind in (StepKind.LOCAL_SLICE, StepKind.LOCAL_PARTITION):
        return 0
    if kind is StepKind.ALL_GATHER:
        return after.total_local_numel() - before.total_local_numel()
    if kind is StepKind.REDUCE_SCATTER:
        return before.total_local_numel() - after.total_local_numel()
    if kind is StepKind.ALL_REDUCE:
        p = before.mesh.shape[axis]
        return 2 * (p - 1) * before.total_local_numel() // p
    return before.total_local_numel() - _all_to_all_kept(before, after, axis)


# Search ---------------------------------------------------------------------------------------


def _check_pair(src: Layout, dst: Layout) -> None:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise RedistributionError(
            f"plan_redistribute needs two hp_layout.Layout, got {type(src).__name__} and "
            f"{type(dst).__name__}"
        )
    if src.global_shape != dst.global_shape:
        raise RedistributionError(
            f"cannot redistribute between global shapes {src.global_shape} and "
            f"{dst.global_shape}; a redistribution keeps the global shape"
        )
    if src.mesh != dst.mesh:
        raise RedistributionError(
            f"cannot redistribute from {src.mesh!r} to {dst.mesh!r}; both layouts must use the "
            "same mesh (same axes and rank grid)"
        )
    for name, p, q in zip(src.mesh.axis_names, src.placements, dst.placements, strict=True):
        if isinstance(q, Partial) and not (isinstance(p, Replicate) or p == q):
            raise RedistributionError(
                f"cannot produce {q!r} on mesh axis {name!r} from {p!r}: a Partial destination "
                f"needs Replicate or the same {q!r} in the source on that axis; redistribute to "
                "Replicate first if a fresh partition of reduced data is really meant"
            )


def _shard_dims(src: Layout) -> tuple[int, ...]:
    """Tensor dims the search may shard along: all of them.

    A temporary shard of a dim that neither end shards can lower the total moved even on one
    tier: on a 2 x 2 mesh, reduce-scatter over one axis, all-reduce the halves over the other
    and all-gather receive 3/4 of two all-reduces' elements. With several tiers the same move
    also shifts traffic off the slow tier.
    """
    return tuple(range(src.ndim))


def _moved(state: Layout, axis: int, target: Placement) -> Layout | None:
    """``state`` with ``target`` on ``axis``, the new shard innermost; None if not a layout."""
    names = state.mesh.axis_names
    name = names[axis]
    ragged = state.ragged_axis
    order = [n for n in state.shard_order if n not in (name, ragged)]
    if isinstance(target, Shard):
        order.append(name)
    if ragged is not None and ragged != name:
        order.append(ragged)
    if isinstance(target, RaggedShard):
        order.append(name)
    placements = list(state.placements)
    placements[axis] = target
    try:
        return Layout(state.global_shape, state.mesh, placements, order)
    except PlacementError:
        return None


def _transitions(
    state: Layout, dst: Layout, dims: tuple[int, ...]
) -> Iterator[tuple[StepKind, int, Layout]]:
    has_ragged = state.ragged_axis is not None
    for axis, (p, want) in enumerate(zip(state.placements, dst.placements, strict=True)):
        targets: list[tuple[StepKind, Placement]] = []
        if isinstance(want, Partial):
            if isinstance(p, Replicate):
                targets.append((StepKind.LOCAL_PARTITION, want))
        elif isinstance(p, Partial):
            targets.append((StepKind.ALL_REDUCE, Replicate()))
            if not has_ragged:
                targets.extend((StepKind.REDUCE_SCATTER, Shard(d)) for d in dims)
                if isinstance(want, RaggedShard):
                    targets.append((StepKind.REDUCE_SCATTER, want))
        elif isinstance(p, Replicate):
            if not has_ragged:
                targets.extend((StepKind.LOCAL_SLICE, Shard(d)) for d in dims)
                if isinstance(want, RaggedShard):
                    targets.append((StepKind.LOCAL_SLICE, want))
        elif isinstance(p, RaggedShard):
            targets.append((StepKind.ALL_GATHER, Replicate()))
        elif not has_ragged and state.dim_sharding(p.dim)[-1] == state.mesh.axis_names[axis]:
            targets.append((StepKind.ALL_GATHER, Replicate()))
            targets.extend((StepKind.ALL_TO_ALL, Shard(d)) for d in dims if d != p.dim)
        for kind, target in targets:
            nxt = _moved(state, axis, target)
            if nxt is not None:
                yield kind, axis, nxt


def _cost_key(
    topology: Topology | None, state: Layout, axis: int, elements: int
) -> tuple[int, ...]:
    """Per-tier elements, slowest tier first, then one step."""
    if topology is None:
        return (elements, 1)
    levels = len(topology.tiers)
    key = [0] * (levels + 1)
    level = topology.tier_level(topology.axis_tier(state.mesh, axis))
    key[levels - 1 - level] = elements
    key[levels] = 1
    return tuple(key)


@lru_cache(maxsize=8192)
def _search(src: Layout, dst: Layout, topology: Topology | None) -> tuple[Step, ...]:
    dims = _shard_dims(src)
    width = 2 if topology is None else len(topology.tiers) + 1
    zero = (0,) * width
    best: dict[Layout, tuple[int, ...]] = {src: zero}
    parent: dict[Layout, Step] = {}
    tie = itertools.count()
    frontier: list[tuple[tuple[int, ...], int, Layout]] = [(zero, next(tie), src)]
    done: set[Layout] = set()
    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state in done:
            continue
        if state == dst:
            break
        done.add(state)
        for kind, axis, nxt in _transitions(state, dst, dims):
            elements = _elements(kind, state, nxt, axis)
            step_cost = _cost_key(topology, state, axis, elements)
            total = tuple(a + b for a, b in zip(cost, step_cost, strict=True))
            if nxt not in best or total < best[nxt]:
                best[nxt] = total
                parent[nxt] = Step(kind, state.mesh.axis_names[axis], state, nxt, elements)
                heapq.heappush(frontier, (total, next(tie), nxt))
    if dst not in best:
        raise RedistributionError(f"no redistribution from {src!r} to {dst!r} was found")
    steps: list[Step] = []
    state = dst
    while state != src:
        step = parent[state]
        steps.append(step)
        state = step.before
    return tuple(reversed(steps))


def plan_redistribute(
    src: Layout, dst: Layout, topology: Topology | None = None
) -> RedistributePlan:
    """The cheapest plan that turns ``src`` shards into ``dst`` shards.

    Cheapest means fewest elements received on the slowest tier of ``topology``, then on each
    faster tier, then fewest steps (without a topology: fewest elements, then fewest steps).
    Results are cached.

    Postconditions: the first step starts at ``src`` and the last ends at ``dst``; each step
    changes the placement of one mesh axis; executing the plan on ``src`` shards yields
    exactly ``dst`` shards; ``elements_moved`` is at most that of
    :func:`plan_gather_then_slice`.

    Raises:
        RedistributionError: when the shapes or meshes differ, or ``dst`` has a Partial that
            ``src`` cannot produce.
    """
    _check_pair(src, dst)
    return RedistributePlan(src, dst, _search(src, dst, topology))


def plan_gather_then_slice(src: Layout, dst: Layout) -> RedistributePlan:
    """The naive baseline: reduce every pending Partial, gather every shard, then slice.

    Partials that ``dst`` keeps stay; every other Partial is all-reduced, every shard is
    all-gathered (innermost first), then ``dst``'s shards are sliced locally in its shard
    order and its new Partials partitioned. Used to bound the planner and in benchmarks.
    """
    _check_pair(src, dst)
    steps: list[Step] = []
    state = src

    def advance(kind: StepKind, axis: int, target: Placement) -> None:
        nonlocal state
        nxt = _moved(state, axis, target)
        assert nxt is not None, (state, axis, target)
        steps.append(
            Step(kind, state.mesh.axis_names[axis], state, nxt, _elements(kind, state, nxt, axis))
        )
        state = nxt

    mesh = src.mesh
    if state.ragged_axis is not None:
        advance(StepKind.ALL_GATHER, mesh.axis_index(state.ragged_axis), Replicate())
    for axis, (p, q) in enumerate(zip(src.placements, dst.placements, strict=True)):
        if isinstance(p, Partial) and p != q:
            advance(StepKind.ALL_REDUCE, axis, Replicate())
    for name in reversed(state.shard_order):
        advance(StepKind.ALL_GATHER, mesh.axis_index(name), Replicate())
    for name in dst.shard_order:
        axis = mesh.axis_index(name)
        advance(StepKind.LOCAL_SLICE, axis, dst.placements[axis])
    for axis, (p, q) in enumerate(zip(state.placements, dst.placements, strict=True)):
        if isinstance(q, Partial) and p != q:
            advance(StepKind.LOCAL_PARTITION, axis, q)
    assert state == dst, (state, dst)
    return RedistributePlan(src, dst, tuple(steps))
