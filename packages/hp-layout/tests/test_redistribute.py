from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from _strategies import layouts, meshes, shapes
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    RaggedShard,
    RedistributePlan,
    RedistributionError,
    ReduceOp,
    Replicate,
    Shard,
    StepKind,
    Topology,
    plan_gather_then_slice,
    plan_redistribute,
)
from hp_layout.reference import assemble, execute, scatter


def _producible(src: Layout, dst: Layout) -> bool:
    return all(
        not isinstance(q, Partial) or isinstance(p, Replicate) or p == q
        for p, q in zip(src.placements, dst.placements, strict=True)
    )


@st.composite
def layout_pairs(draw: st.DrawFn, max_ranks: int = 16) -> tuple[Layout, Layout]:
    mesh = draw(meshes(max_ranks=max_ranks))
    shape = draw(shapes(max_dims=4, max_size=5))
    op = draw(st.sampled_from(list(ReduceOp)))
    return draw(layouts(mesh, shape, op=op)), draw(layouts(mesh, shape, op=op))


def _check_result(plan: RedistributePlan, array: np.ndarray, seed: int) -> list[int]:
    shards = scatter(array, plan.src, rng=np.random.default_rng(seed))
    result = execute(plan, shards)
    dst = plan.dst
    for rank in dst.mesh.ranks:
        assert result.shards[rank].shape == dst.local_shape(rank)
    if dst.has_partial:
        whole = assemble(result.shards, dst)
        if any(p.op is ReduceOp.AVG for p in dst.placements if isinstance(p, Partial)):
            np.testing.assert_allclose(whole, array, rtol=0, atol=1e-9)
        else:
            np.testing.assert_array_equal(whole, array)
    else:
        expected = scatter(array, dst)
        for rank in dst.mesh.ranks:
            np.testing.assert_allclose(result.shards[rank], expected[rank], rtol=0, atol=1e-9)
    return list(result.received)


@given(layout_pairs(), st.integers(0, 2**16))
def test_every_plan_yields_exactly_the_destination_shards(
    pair: tuple[Layout, Layout], seed: int
) -> None:
    src, dst = pair
    if not _producible(src, dst):
        with pytest.raises(RedistributionError, match="a Partial destination needs Replicate"):
            plan_redistribute(src, dst)
        return
    array = np.random.default_rng(seed).integers(-50, 50, size=src.global_shape)
    plan = plan_redistribute(src, dst)
    received = _check_result(plan, array, seed)
    # Accounting is exact: the executor counts what each rank really received.
    assert received == [s.elements for s in plan.steps]
    # Steps chain, each changes one axis.
    state = src
    for step in plan.steps:
        assert step.before == state
        changed = [
            n
            for n, p, q in zip(
                state.mesh.axis_names, step.before.placements, step.after.placements, strict=True
            )
            if p != q
        ]
        assert changed in ([step.axis], [])
        state = step.after
    assert state == dst
    naive = plan_gather_then_slice(src, dst)
    naive_received = _check_result(naive, array, seed)
    assert naive_received == [s.elements for s in naive.steps]
    assert plan.elements_moved <= naive.elements_moved


@given(layout_pairs(max_ranks=24))
def test_topology_plans_move_no_more_over_the_slow_tier(pair: tuple[Layout, Layout]) -> None:
    src, dst = pair
    assume(_producible(src, dst))
    world = max(src.mesh.ranks) + 1
    hosts = 2 if world % 2 == 0 else 1
    topo = (
        Topology.two_tier_cluster(hosts, world // hosts)
        if hosts > 1
        else Topology.single_host(world)
    )
    plan = plan_redistribute(src, dst, topo)
    naive = plan_gather_then_slice(src, dst)
    slow = topo.tiers[-1].name
    assert plan.bytes_by_tier(topo, 4)[slow] <= naive.bytes_by_tier(topo, 4)[slow]
    assert plan.estimated_time(topo, 4) <= plan.estimated_time(topo, 8)
    array = np.arange(src.numel).reshape(src.global_shape)
    _check_result(plan, array, 0)


MESH = Mesh((2, 2), ("dp", "tp"))


@pytest.mark.parametrize(
    ("src", "dst", "kinds"),
    [
        ([Shard(0), Replicate()], [Replicate(), Replicate()], [StepKind.ALL_GATHER]),
        ([Replicate(), Replicate()], [Replicate(), Shard(1)], [StepKind.LOCAL_SLICE]),
        ([Partial(), Replicate()], [Replicate(), Replicate()], [StepKind.ALL_REDUCE]),
        ([Partial(), Replicate()], [Shard(1), Replicate()], [StepKind.REDUCE_SCATTER]),
        ([Shard(0), Replicate()], [Shard(1), Replicate()], [StepKind.ALL_TO_ALL]),
        ([Replicate(), Replicate()], [Replicate(), Partial("max")], [StepKind.LOCAL_PARTITION]),
        ([Partial(), Shard(0)], [Partial(), Shard(0)], []),
        # Slice first so the all-reduce moves half the data.
        (
            [Partial(), Replicate()],
            [Replicate(), Shard(0)],
            [StepKind.LOCAL_SLICE, StepKind.ALL_REDUCE],
        ),
    ],
)
def test_known_cheapest_plans(src: list[object], dst: list[object], kinds: list[StepKind]) -> None:
    plan = plan_redistribute(Layout((4, 6), MESH, src), Layout((4, 6), MESH, dst))  # type: ignore[arg-type]
    assert [s.kind for s in plan.steps] == kinds


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        # All-to-all over tp while dp holds partial sums (each dp rank keeps its own copy).
        ([Partial(), Shard(0)], [Partial(), Shard(1)]),
        ([Partial("max"), Shard(1)], [Partial("max"), Shard(0)]),
        # ... while dp replicates, and nested under a dp shard of another dim.
        ([Replicate(), Shard(0)], [Replicate(), Shard(1)]),
        ([Shard(1), Shard(0)], [Shard(1), Shard(1)]),
    ],
)
def test_all_to_all_accounting_counts_every_copy(src: list[object], dst: list[object]) -> None:
    mesh = Mesh((2, 3), ("dp", "tp"))
    plan = plan_redistribute(Layout((5, 7), mesh, src), Layout((5, 7), mesh, dst))  # type: ignore[arg-type]
    assert StepKind.ALL_TO_ALL in [s.kind for s in plan.steps]
    received = _check_result(plan, np.arange(35).reshape(5, 7), 1)
    assert received == [s.elements for s in plan.steps]


def test_nested_order_is_respected() -> None:
    src = Layout((6, 4), MESH, [Replicate(), Replicate()])
    dst = Layout((6, 4), MESH, [Shard(0), Shard(0)], ["tp", "dp"])
    plan = plan_redistribute(src, dst)
    assert [(s.kind, s.axis) for s in plan.steps] == [
        (StepKind.LOCAL_SLICE, "tp"),
        (StepKind.LOCAL_SLICE, "dp"),
    ]
    _check_result(plan, np.arange(24).reshape(6, 4), 0)


def test_fsdp_ragged_to_tp_shards() -> None:
    src = Layout((6, 4), MESH, [RaggedShard((5, 7)), Shard(0)])
    dst = Layout((6, 4), MESH, [Replicate(), Shard(1)])
    plan = plan_redistribute(src, dst)
    assert plan.steps[0].kind is StepKind.ALL_GATHER
    assert plan.steps[0].axis == "dp"
    _check_result(plan, np.arange(24).reshape(6, 4), 0)


def test_topology_prefers_moving_bytes_over_the_fast_tier() -> None:
    mesh = Mesh((2, 4), ("node", "local"))
    topo = Topology.two_tier_cluster(hosts=2, ranks_per_host=4)
    src = Layout((8, 8), mesh, [Partial(), Partial()])
    dst = Layout((8, 8), mesh, [Replicate(), Replicate()])
    plan = plan_redistribute(src, dst, topo)
    # Reduce-scatter inside the host first, all-reduce the quarter across hosts, all-gather
    # inside the host: the slow tier carries a quarter of what a plain all-reduce would.
    assert [(s.kind, s.axis) for s in plan.steps] == [
        (StepKind.REDUCE_SCATTER, "local"),
        (StepKind.ALL_REDUCE, "node"),
        (StepKind.ALL_GATHER, "local"),
    ]
    # Two plain all-reduces (the naive plan) carry the whole buffer over the cluster tier.
    naive = plan_gather_then_slice(src, dst)
    assert [s.kind for s in naive.steps] == [StepKind.ALL_REDUCE] * 2
    assert plan.bytes_by_tier(topo, 4)["cluster"] * 4 == naive.bytes_by_tier(topo, 4)["cluster"]
    # Without a topology the reduction is hierarchical too (fewer elements in all); which axis
    # it reduce-scatters first is then a tie.
    flat = plan_redistribute(src, dst)
    assert [s.kind for s in flat.steps] == [s.kind for s in plan.steps]
    assert flat.elements_moved == plan.elements_moved < naive.elements_moved


def test_estimated_time_is_the_alpha_beta_sum_of_the_steps() -> None:
    mesh = Mesh((2, 4), ("node", "local"))
    topo = Topology.two_tier_cluster(hosts=2, ranks_per_host=4)
    plan = plan_redistribute(
        Layout((8, 8), mesh, [Partial(), Partial()]),
        Layout((8, 8), mesh, [Replicate(), Replicate()]),
        topo,
    )
    assert [s.kind for s in plan.steps] == [
        StepKind.REDUCE_SCATTER,
        StepKind.ALL_REDUCE,
        StepKind.ALL_GATHER,
    ]
    # fp32; host tier 100 GB/s, 5 us; cluster tier 12.5 GB/s, 20 us. Each collective is costed
    # with the buffer one rank starts from (reduce-scatter input: 64 elements; all-reduce of
    # the 16-element quarter) or ends with (all-gather output: 64 elements).
    reduce_scatter = 3 * 5e-6 + 3 / 4 * 256 / 100e9
    all_reduce = 2 * (1 * 20e-6 + 1 / 2 * 64 / 12.5e9)
    all_gather = 3 * 5e-6 + 3 / 4 * 256 / 100e9
    expected = reduce_scatter + all_reduce + all_gather
    assert plan.estimated_time(topo, 4) == pytest.approx(expected, rel=1e-12)
    assert plan.bytes_by_tier(topo, 4) == {"host": 2 * 8 * 48 * 4, "cluster": 8 * 16 * 4}


def test_plans_are_cached_and_immutable() -> None:
    src = Layout((4, 6), MESH, [Shard(0), Shard(1)])
    dst = Layout((4, 6), MESH, [Shard(1), Shard(0)])
    first = plan_redistribute(src, dst)
    assert plan_redistribute(src, dst).steps is first.steps
    with pytest.raises(AttributeError):
        first.steps = ()  # type: ignore[misc]
    assert "all_to_all" in str(first)


def test_planning_on_768_ranks() -> None:
    mesh = Mesh((8, 12, 8), ("pp", "dp", "tp"))
    topo = Topology.ascend_supernode()
    src = Layout((4096, 11008), mesh, [Replicate(), Shard(0), Shard(1)])
    dst = Layout((4096, 11008), mesh, [Shard(1), Replicate(), Shard(0)])
    plan = plan_redistribute(src, dst, topo)
    assert plan.steps[-1].after == dst
    assert plan.elements_moved <= plan_gather_then_slice(src, dst).elements_moved


def test_errors_name_what_differs() -> None:
    a = Layout((4, 6), MESH, [Shard(0), Replicate()])
    with pytest.raises(RedistributionError, match=r"global shapes \(4, 6\) and \(6, 4\)"):
        plan_redistribute(a, Layout((6, 4), MESH, [Shard(0), Replicate()]))
    other = Mesh((2, 2), ("dp", "tp"), (0, 2, 1, 3))
    with pytest.raises(RedistributionError, match="same mesh"):
        plan_redistribute(a, Layout((4, 6), other, [Shard(0), Replicate()]))
    with pytest.raises(
        RedistributionError,
        match=r"cannot produce Partial\('sum'\) on mesh axis 'dp' from Shard\(0\)",
    ):
        plan_redistribute(a, Layout((4, 6), MESH, [Partial(), Replicate()]))
    with pytest.raises(RedistributionError, match=r"from Partial\('max'\)"):
        plan_redistribute(
            Layout((4, 6), MESH, [Partial("max"), Replicate()]),
            Layout((4, 6), MESH, [Partial("sum"), Replicate()]),
        )
    with pytest.raises(RedistributionError, match=r"needs two hp_layout\.Layout"):
        plan_redistribute(a, "Shard(0)")  # type: ignore[arg-type]
