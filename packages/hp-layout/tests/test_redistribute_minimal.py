"""The planner's "cheapest plan" claim against brute force over small meshes.

The oracle is written here, apart from the planner: the legal one-axis steps come from the
rules in ``hp_layout.redistribute``'s docstring (undo only the innermost shard of a dim, new
shards innermost, a RaggedShard applied last, a Partial destination only from Replicate), every
dim may be sharded (on one tier the planner searches fewer; its docstring says the others never
help), each step's elements are what the numpy reference executor counts when it runs that one
step, and the minimum runs over *every* sequence of up to ``MAX_STEPS`` steps (one relaxation
round per step length, not a priority-queue search).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from _strategies import layouts, meshes, shapes
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    PlacementError,
    RaggedShard,
    RedistributePlan,
    ReduceOp,
    Replicate,
    Shard,
    Step,
    StepKind,
    Topology,
    plan_redistribute,
)
from hp_layout.reference import execute, scatter

MAX_STEPS = 6
Cost = tuple[int, ...]


def _with(state: Layout, axis: int, target: Placement) -> Layout | None:
    """``state`` with ``target`` on ``axis``: a new shard innermost, a RaggedShard last."""
    name = state.mesh.axis_names[axis]
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


def _legal_steps(state: Layout, dst: Layout) -> Iterator[tuple[StepKind, int, Layout]]:
    """Every step the documented rules allow from ``state`` (any dim may be sharded)."""
    ragged = state.ragged_axis is not None
    dims = range(state.ndim)
    for axis, (p, want) in enumerate(zip(state.placements, dst.placements, strict=True)):
        moves: list[tuple[StepKind, Placement]] = []
        if isinstance(want, Partial):
            # A Partial destination: only a local partition of replicated values.
            if isinstance(p, Replicate):
                moves.append((StepKind.LOCAL_PARTITION, want))
        elif isinstance(p, Partial):
            moves.append((StepKind.ALL_REDUCE, Replicate()))
            if not ragged:
                moves += [(StepKind.REDUCE_SCATTER, Shard(d)) for d in dims]
                if isinstance(want, RaggedShard):
                    moves.append((StepKind.REDUCE_SCATTER, want))
        elif isinstance(p, Replicate):
            if not ragged:
                moves += [(StepKind.LOCAL_SLICE, Shard(d)) for d in dims]
                if isinstance(want, RaggedShard):
                    moves.append((StepKind.LOCAL_SLICE, want))
        elif isinstance(p, RaggedShard):
            moves.append((StepKind.ALL_GATHER, Replicate()))
        elif (
            isinstance(p, Shard)
            and not ragged
            and state.dim_sharding(p.dim)[-1] == state.mesh.axis_names[axis]
        ):
            # Only the innermost shard of a dim can be undone.
            moves.append((StepKind.ALL_GATHER, Replicate()))
            moves += [(StepKind.ALL_TO_ALL, Shard(d)) for d in dims if d != p.dim]
        for kind, target in moves:
            nxt = _with(state, axis, target)
            if nxt is not None:
                yield kind, axis, nxt


class _Oracle:
    """Step costs from the reference executor; the cheapest sequence by exhaustive rounds."""

    def __init__(self, topology: Topology | None) -> None:
        self.topology = topology
        self.received: dict[tuple[Layout, StepKind, str, Layout], int] = {}

    def elements(self, before: Layout, kind: StepKind, axis: str, after: Layout) -> int:
        key = (before, kind, axis, after)
        if key not in self.received:
            one = RedistributePlan(before, after, (Step(kind, axis, before, after, 0),))
            array = np.arange(before.numel, dtype=np.int64).reshape(before.global_shape)
            shards = scatter(array, before, rng=np.random.default_rng(0))
            self.received[key] = execute(one, shards).received[0]
        return self.received[key]

    def step_cost(self, before: Layout, kind: StepKind, axis: str, after: Layout) -> Cost:
        """(elements per tier, slowest tier first; then 1 step)."""
        elements = self.elements(before, kind, axis, after)
        if self.topology is None:
            return (elements, 1)
        tiers = self.topology.tiers
        level = tiers.index(self.topology.axis_tier(before.mesh, axis))
        per_tier = [0] * len(tiers)
        per_tier[len(tiers) - 1 - level] = elements
        return (*per_tier, 1)

    def cheapest(self, src: Layout, dst: Layout) -> Cost | None:
        """The least cost of any legal sequence of at most MAX_STEPS steps, or None."""
        width = 2 if self.topology is None else len(self.topology.tiers) + 1
        best: dict[Layout, Cost] = {src: (0,) * width}
        for _ in range(MAX_STEPS):
            improved = dict(best)
            for state, cost in best.items():
                for kind, axis, nxt in _legal_steps(state, dst):
                    name = state.mesh.axis_names[axis]
                    step = self.step_cost(state, kind, name, nxt)
                    total = tuple(a + b for a, b in zip(cost, step, strict=True))
                    if nxt not in improved or total < improved[nxt]:
                        improved[nxt] = total
            if improved == best:
                break
            best = improved
        return best.get(dst)

    def plan_cost(self, plan: RedistributePlan, dst: Layout) -> Cost:
        """The plan's cost under the same step costs; each step must be a legal one."""
        width = 2 if self.topology is None else len(self.topology.tiers) + 1
        total: Cost = (0,) * width
        for s in plan.steps:
            axis = s.before.mesh.axis_index(s.axis)
            assert (s.kind, axis, s.after) in set(_legal_steps(s.before, dst)), str(s)
            step = self.step_cost(s.before, s.kind, s.axis, s.after)
            total = tuple(a + b for a, b in zip(total, step, strict=True))
        return total


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
    mesh = draw(meshes(max_axes=2, max_size=3, max_ranks=6))
    shape = draw(shapes(max_dims=2, max_size=5))
    op = draw(st.sampled_from(list(ReduceOp)))
    return draw(layouts(mesh, shape, op=op)), draw(layouts(mesh, shape, op=op))


def _producible(src: Layout, dst: Layout) -> bool:
    return all(
        not isinstance(q, Partial) or isinstance(p, Replicate) or p == q
        for p, q in zip(src.placements, dst.placements, strict=True)
    )


@settings(max_examples=120)
@given(_pairs())
def test_plans_are_the_cheapest_legal_sequence(pair: tuple[Layout, Layout]) -> None:
    src, dst = pair
    assume(_producible(src, dst))
    oracle = _Oracle(None)
    plan = plan_redistribute(src, dst)
    assert len(plan.steps) <= MAX_STEPS
    assert oracle.plan_cost(plan, dst) == oracle.cheapest(src, dst)


@settings(max_examples=120)
@given(_pairs())
def test_topology_plans_are_the_cheapest_per_tier(pair: tuple[Layout, Layout]) -> None:
    src, dst = pair
    assume(_producible(src, dst))
    world = max(src.mesh.ranks) + 1
    assume(world % 2 == 0 and world >= 4)
    topology = Topology.two_tier_cluster(2, world // 2)
    oracle = _Oracle(topology)
    plan = plan_redistribute(src, dst, topology)
    assert len(plan.steps) <= MAX_STEPS
    assert oracle.plan_cost(plan, dst) == oracle.cheapest(src, dst)


@pytest.mark.parametrize("ranks", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["node-major", "local-major"])
def test_every_pair_on_a_two_tier_2x2_mesh(ranks: tuple[int, ...]) -> None:
    """Every src/dst pair of Replicate, Partial, Shard(0), Shard(1) on a 2 x 2 mesh over two
    hosts of 2 (an even 4 x 6 and an uneven 3 x 5 tensor): the slow tier first, then the fast
    one, then steps."""
    mesh = Mesh((2, 2), ("a", "b"), ranks)
    topology = Topology.two_tier_cluster(2, 2)
    oracle = _Oracle(topology)
    choices: list[Placement] = [Replicate(), Partial(), Shard(0), Shard(1)]
    pairs = itertools.product(itertools.product(choices, repeat=2), repeat=2)
    for shape, (src_p, dst_p) in itertools.product([(4, 6), (3, 5)], pairs):
        src = Layout(shape, mesh, src_p)
        dst = Layout(shape, mesh, dst_p)
        if not _producible(src, dst):
            continue
        plan = plan_redistribute(src, dst, topology)
        assert oracle.plan_cost(plan, dst) == oracle.cheapest(src, dst), (src, dst)


def test_two_tier_examples_against_brute_force() -> None:
    """Hand-picked cases where the slow tier decides (the search must go hierarchical, keep
    a ragged destination a reduce-scatter, and slice before reducing)."""
    topology = Topology.two_tier_cluster(2, 2)
    ragged = RaggedShard((5, 7))
    cases: list[tuple[Mesh, list[Placement], list[Placement]]] = [
        (Mesh((2, 2), ("node", "local")), [Partial(), Partial()], [Replicate(), Replicate()]),
        (Mesh((2, 2), ("node", "local")), [Partial(), Replicate()], [Replicate(), Shard(0)]),
        (Mesh((2, 2), ("local", "node"), (0, 2, 1, 3)), [Partial(), Partial()], [Shard(1)] * 2),
        (Mesh((2, 2), ("node", "local")), [Replicate(), Partial()], [Replicate(), ragged]),
    ]
    for mesh, src_p, dst_p in cases:
        src = Layout((4, 3), mesh, src_p)
        dst = Layout((4, 3), mesh, dst_p)
        for topo in (None, topology):
            oracle = _Oracle(topo)
            plan = plan_redistribute(src, dst, topo)
            assert oracle.plan_cost(plan, dst) == oracle.cheapest(src, dst), (src, dst, topo)
