"""Transfer plans between layouts on different meshes (hp_layout.transfer).

Oracles are brute force on element index sets: every element of the global tensor gets its
row-major index, and a region's or a box's elements are found by slicing ``np.arange`` of the
global shape, never through the planner's own region arithmetic.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray

from _strategies import layouts, meshes, shapes
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    RaggedShard,
    RedistributionError,
    Region,
    Replicate,
    Shard,
    Topology,
)
from hp_layout.reference import execute_transfer
from hp_layout.region import Box
from hp_layout.transfer import (
    Piece,
    TransferPlan,
    local_index_runs,
    plan_full_gather_transfer,
    plan_transfer,
)

Array = NDArray[Any]
PLANNERS = (plan_transfer, plan_full_gather_transfer)


# Brute-force helpers ---------------------------------------------------------------------------


def _ids(shape: tuple[int, ...]) -> Array:
    return np.arange(math.prod(shape)).reshape(shape)


def _slice(array: Array, region: Region) -> Array:
    """The local data of ``region``: the box sliced out, then the flat range of it."""
    part = array[tuple(slice(a, b) for a, b in region.box)]
    if region.flat is None:
        return part
    return part.reshape(-1)[region.flat[0] : region.flat[1]]


def _region_set(shape: tuple[int, ...], region: Region) -> set[int]:
    return set(_slice(_ids(shape), region).reshape(-1).tolist())


def _box_ids(shape: tuple[int, ...], box: Box) -> list[int]:
    ids: list[int] = _ids(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1).tolist()
    return ids


def _level(topology: Topology | None, a: int, b: int) -> int:
    if topology is None:
        return 0
    return topology.tier_level(topology.tier_of_group((a, b)))


def _expected_receive_sets(plan: TransferPlan, phase: int) -> dict[int, set[int]]:
    """What each receiver must hold after ``phase``, from the method's definition."""
    shape = plan.src.global_shape
    if plan.method == "full_gather" and phase == 0:
        everything = set(range(math.prod(shape)))
        return dict.fromkeys(plan.src.mesh.ranks, everything)
    return {r: _region_set(shape, plan.dst.local_region(r)) for r in plan.dst.mesh.ranks}


def _sender_set(plan: TransferPlan, phase: int, rank: int) -> set[int]:
    """What ``rank`` holds when it sends in ``phase``, from the method's definition."""
    shape = plan.src.global_shape
    if phase == 0:
        return _region_set(shape, plan.src.local_region(rank))
    assert rank in plan.src.mesh.ranks, f"phase {phase} sender {rank} is not a source rank"
    return set(range(math.prod(shape)))


def _check_plan(plan: TransferPlan, topology: Topology | None) -> None:
    """Every postcondition of a plan, by brute force on element index sets."""
    shape = plan.src.global_shape
    for phase, pieces in enumerate(plan.phases):
        wanted = _expected_receive_sets(plan, phase)
        assert plan.receivers(phase) == tuple(sorted(wanted))
        assert all(p.dst_rank in wanted for p in pieces), "a piece goes to a non-receiver"
        listed = [p for r in wanted for p in plan.receives(r, phase)]
        assert sorted(listed) == sorted(pieces)
        sent = [p for r in set(plan.src.mesh.ranks) for p in plan.sends(r, phase)]
        assert sorted(sent) == sorted(pieces)
        for rank, target in wanted.items():
            got: list[int] = []
            for piece in plan.receives(rank, phase):
                ids = _box_ids(shape, piece.box)
                assert ids, f"empty piece {piece}"
                got.extend(ids)
                held = _sender_set(plan, phase, piece.src_rank)
                assert set(ids) <= held, f"{piece} is not inside its sender's data"
                if piece.local:
                    continue
                # The receiver never fetches what it already holds ...
                if phase == 0 and rank in plan.src.mesh.ranks:
                    own = _region_set(shape, plan.src.local_region(rank))
                    assert not set(ids) & own, f"{piece} fetches elements rank {rank} holds"
                if phase == 1:
                    assert rank not in plan.src.mesh.ranks, f"{piece} fetches a held region"
                # ... and fetches from the fastest tier any holder offers.
                holders = [
                    s for s in plan.src.mesh.ranks if set(ids) <= _sender_set(plan, phase, s)
                ]
                best = min(_level(topology, s, rank) for s in holders)
                assert _level(topology, piece.src_rank, rank) == best, f"{piece} is not fastest"
            assert len(got) == len(set(got)), f"rank {rank} receives an element twice"
            assert set(got) == target, f"rank {rank} misses {sorted(target - set(got))[:5]}"
        # Sends and receives agree on the box order between each pair of ranks.
        for s in plan.src.mesh.ranks:
            for d in wanted:
                out = [p.box for p in plan.sends(s, phase) if p.dst_rank == d]
                into = [p.box for p in plan.receives(d, phase) if p.src_rank == s]
                assert out == into


def _direct_receive_count(src: Layout, dst: Layout) -> int:
    """Elements the destination ranks lack, by brute force: what a direct plan must move."""
    shape = src.global_shape
    total = 0
    for d in dst.mesh.ranks:
        need = _region_set(shape, dst.local_region(d))
        if d in src.mesh.ranks:
            need -= _region_set(shape, src.local_region(d))
        total += len(need)
    return total


def _source_shards(array: Array, layout: Layout) -> dict[int, Array]:
    return {r: _slice(array, layout.local_region(r)).copy() for r in layout.mesh.ranks}


# Random cases ----------------------------------------------------------------------------------


@st.composite
def transfer_cases(draw: st.DrawFn) -> tuple[Layout, Layout, Topology | None]:
    """Two layouts of one shape on random meshes (1-3 axes) whose rank sets may overlap,
    coincide or be disjoint; Shard (uneven included), Replicate and RaggedShard; with no
    topology or a two-tier one."""
    shape = draw(shapes(max_dims=3, max_size=5))
    src_mesh = draw(meshes(max_axes=3, max_size=3, max_ranks=8))
    dst_mesh = draw(meshes(max_axes=3, max_size=3, max_ranks=8))
    if draw(st.booleans()):
        shift = draw(st.integers(0, 12))
        dst_mesh = Mesh(
            dst_mesh.shape, dst_mesh.axis_names, tuple(r + shift for r in dst_mesh.ranks)
        )
    src = draw(layouts(src_mesh, shape, allow_partial=False))
    dst = draw(layouts(dst_mesh, shape, allow_partial=False))
    topology = None
    if draw(st.booleans()):
        per_host = draw(st.sampled_from([1, 2, 3, 4]))
        world = max(src_mesh.ranks + dst_mesh.ranks) + 1
        topology = Topology.two_tier_cluster(max(2, -(-world // per_host)), per_host)
    return src, dst, topology


@given(transfer_cases(), st.integers(0, 2**16))
def test_random_plans_tile_every_receiver_and_reproduce_the_destination_shards(
    case: tuple[Layout, Layout, Topology | None], seed: int
) -> None:
    src, dst, topology = case
    array = np.random.default_rng(seed).integers(-1000, 1000, size=src.global_shape)
    for planner in PLANNERS:
        plan = planner(src, dst, topology)
        _check_plan(plan, topology)
        out = execute_transfer(plan, _source_shards(array, src))
        for r in dst.mesh.ranks:
            np.testing.assert_array_equal(out[r], _slice(array, dst.local_region(r)))
    direct = plan_transfer(src, dst, topology)
    assert direct.elements_moved() == _direct_receive_count(src, dst)


@given(transfer_cases())
def test_direct_moves_no_more_than_full_gather(
    case: tuple[Layout, Layout, Topology | None],
) -> None:
    src, dst, topology = case
    direct = plan_transfer(src, dst, topology)
    gather = plan_full_gather_transfer(src, dst, topology)
    assert direct.elements_moved() <= gather.elements_moved()
    tiers = topology or Topology.single_host(max(src.mesh.ranks + dst.mesh.ranks) + 1)
    by_direct, by_gather = direct.elements_by_tier(tiers), gather.elements_by_tier(tiers)
    assert sum(by_direct.values()) == direct.elements_moved()
    assert sum(by_gather.values()) == gather.elements_moved()
    assert direct.bytes_by_tier(tiers, 2) == {k: 2 * v for k, v in by_direct.items()}
    # Per tier it holds when each outside destination reaches every source over one tier.
    outside = [d for d in dst.mesh.ranks if d not in src.mesh.ranks]
    if all(len({_level(tiers, s, d) for s in src.mesh.ranks}) == 1 for d in outside):
        for name in by_direct:
            assert by_direct[name] <= by_gather[name], (name, by_direct, by_gather)


# Hand-computed cases ---------------------------------------------------------------------------


def _fsdp_tp(ranks: tuple[int, ...] = (0, 1, 2, 3)) -> Layout:
    # TP splits rows first, FSDP splits each TP shard: rank 0 rows [0, 2), 1 [4, 6),
    # 2 [2, 4), 3 [6, 8).
    mesh = Mesh((2, 2), ("dp_shard", "tp"), ranks)
    return Layout((8, 4), mesh, [Shard(0), Shard(0)], ["tp", "dp_shard"])


def _rollout(ranks: tuple[int, ...]) -> Layout:
    # TP 2 replicated over 2 rollout groups: tp 0 rows [0, 4), tp 1 rows [4, 8).
    return Layout((8, 4), Mesh((2, 2), ("rollout", "tp"), ranks), [Replicate(), Shard(0)])


def _rows(a: int, b: int) -> Box:
    return ((a, b), (0, 4))


def test_fsdp_tp_to_replicated_tp_on_the_same_ranks() -> None:
    topology = Topology.two_tier_cluster(2, 2)
    src, dst = _fsdp_tp(), _rollout((0, 1, 2, 3))
    plan = plan_transfer(src, dst, topology)
    assert plan.method == "direct"
    assert plan.phases == (
        (
            Piece(0, 0, _rows(0, 2)),
            Piece(2, 0, _rows(2, 4)),
            Piece(1, 1, _rows(4, 6)),
            Piece(3, 1, _rows(6, 8)),
            Piece(0, 2, _rows(0, 2)),
            Piece(2, 2, _rows(2, 4)),
            Piece(1, 3, _rows(4, 6)),
            Piece(3, 3, _rows(6, 8)),
        ),
    )
    assert plan.receives(0, 0) == (Piece(0, 0, _rows(0, 2)), Piece(2, 0, _rows(2, 4)))
    assert plan.sends(2, 0) == (Piece(2, 0, _rows(2, 4)), Piece(2, 2, _rows(2, 4)))
    assert plan.elements_moved() == 32
    # Ranks 0 and 2 sit on different hosts of 2: every move crosses the cluster tier.
    assert plan.elements_by_tier(topology) == {"host": 0, "cluster": 32}
    assert plan.bytes_by_tier(topology, 2) == {"host": 0, "cluster": 64}
    gather = plan_full_gather_transfer(src, dst, topology)
    # Each rank fetches 3 shards of 8: one from its host peer, two across.
    assert gather.elements_by_tier(topology) == {"host": 32, "cluster": 64}
    assert all(p.local for p in gather.phases[1])
    assert gather.receive_region(0, 0) == Region(((0, 8), (0, 4)))
    assert gather.send_region(0, 1) == Region(((0, 8), (0, 4)))


def test_fsdp_tp_to_replicated_tp_on_another_host() -> None:
    topology = Topology.two_tier_cluster(2, 4)
    src, dst = _fsdp_tp(), _rollout((4, 5, 6, 7))
    plan = plan_transfer(src, dst, topology)
    # Each rollout rank takes its TP rows from the two FSDP shards that hold them.
    assert plan.phases[0] == (
        Piece(0, 4, _rows(0, 2)),
        Piece(2, 4, _rows(2, 4)),
        Piece(1, 5, _rows(4, 6)),
        Piece(3, 5, _rows(6, 8)),
        Piece(0, 6, _rows(0, 2)),
        Piece(2, 6, _rows(2, 4)),
        Piece(1, 7, _rows(4, 6)),
        Piece(3, 7, _rows(6, 8)),
    )
    assert plan.elements_by_tier(topology) == {"host": 0, "cluster": 64}
    gather = plan_full_gather_transfer(src, dst, topology)
    # Phase 0: each trainer rank fetches 24 elements inside its host; phase 1: each rollout
    # rank fetches its 16 from a trainer rank, the senders balanced one per receiver.
    assert gather.elements_by_tier(topology) == {"host": 96, "cluster": 64}
    assert [p.src_rank for p in gather.phases[1]] == [0, 1, 2, 3]
    assert gather.receivers(0) == (0, 1, 2, 3)
    assert gather.receivers(1) == (4, 5, 6, 7)


def test_ragged_fsdp_regions_are_moved_box_by_box() -> None:
    # TP splits the 4 x 3 rows in two; FSDP cuts each TP shard's 6 elements into 4 + 2.
    mesh = Mesh((2, 2), ("dp_shard", "tp"), (0, 1, 2, 3))
    src = Layout((4, 3), mesh, [RaggedShard((4, 2)), Shard(0)])
    dst = Layout((4, 3), Mesh((2, 2), ("rollout", "tp"), (4, 5, 6, 7)), [Replicate(), Shard(0)])
    topology = Topology.two_tier_cluster(2, 4)
    plan = plan_transfer(src, dst, topology)
    # Rank 0 holds (0, 0..2) and (1, 0); rank 2 holds (1, 1..2).
    assert plan.receives(4, 0) == (
        Piece(0, 4, ((0, 1), (0, 3))),
        Piece(0, 4, ((1, 2), (0, 1))),
        Piece(2, 4, ((1, 2), (1, 3))),
    )
    assert plan.elements_by_tier(topology) == {"host": 0, "cluster": 24}
    gather = plan_full_gather_transfer(src, dst, topology)
    assert gather.elements_by_tier(topology) == {"host": 36, "cluster": 24}
    array = np.arange(12).reshape(4, 3) * 7
    out = execute_transfer(plan, _source_shards(array, src))
    np.testing.assert_array_equal(out[6], array[0:2])
    np.testing.assert_array_equal(out[7], array[2:4])


def test_one_rank_source_to_four_ranks() -> None:
    src = Layout((4, 4), Mesh((1,), ("x",), (0,)), [Replicate()])
    dst = Layout((4, 4), Mesh((2, 2), ("a", "b")), [Shard(0), Shard(1)])
    plan = plan_transfer(src, dst)
    assert plan.phases[0] == (
        Piece(0, 0, ((0, 2), (0, 2))),
        Piece(0, 1, ((0, 2), (2, 4))),
        Piece(0, 2, ((2, 4), (0, 2))),
        Piece(0, 3, ((2, 4), (2, 4))),
    )
    assert plan.phases[0][0].local
    assert plan.elements_moved() == 12
    gather = plan_full_gather_transfer(src, dst)
    assert gather.phases[0] == (Piece(0, 0, ((0, 4), (0, 4))),)
    assert gather.phases[1] == plan.phases[0]
    assert gather.elements_moved() == 12


def test_equally_fast_holders_share_the_sends() -> None:
    # Two replicas on one host feed four shards: the least loaded sender wins each tie.
    src = Layout((8,), Mesh((2,), ("r",), (0, 1)), [Replicate()])
    dst = Layout((8,), Mesh((4,), ("s",), (2, 3, 4, 5)), [Shard(0)])
    plan = plan_transfer(src, dst)
    assert [(p.src_rank, p.dst_rank) for p in plan.phases[0]] == [(0, 2), (1, 3), (0, 4), (1, 5)]


def test_a_holder_on_the_fast_tier_beats_a_less_loaded_one_across() -> None:
    # Ranks 0 and 4 both hold everything; receivers 1, 2, 3 share rank 0's host.
    topology = Topology.two_tier_cluster(2, 4)
    src = Layout((6,), Mesh((2,), ("r",), (4, 0)), [Replicate()])
    dst = Layout((6,), Mesh((3,), ("s",), (1, 2, 3)), [Shard(0)])
    plan = plan_transfer(src, dst, topology)
    assert [p.src_rank for p in plan.phases[0]] == [0, 0, 0]
    assert plan.elements_by_tier(topology) == {"host": 6, "cluster": 0}


def test_direct_can_move_more_over_the_slow_tier_than_full_gather() -> None:
    # The shards sit on two hosts; three receivers share host 0 with rank 0. Direct fetches
    # rank 4's half across for each receiver; full gather fetches it once, fans out inside.
    topology = Topology.two_tier_cluster(2, 4)
    src = Layout((4,), Mesh((2,), ("s",), (0, 4)), [Shard(0)])
    dst = Layout((4,), Mesh((3,), ("r",), (1, 2, 3)), [Replicate()])
    direct = plan_transfer(src, dst, topology)
    gather = plan_full_gather_transfer(src, dst, topology)
    assert direct.elements_by_tier(topology) == {"host": 6, "cluster": 6}
    assert gather.elements_by_tier(topology) == {"host": 12, "cluster": 4}
    assert direct.elements_moved() == 12 < gather.elements_moved() == 16


def test_empty_and_zero_dim_tensors() -> None:
    src = Layout((0, 3), Mesh((2,), ("a",)), [Shard(0)])
    dst = Layout((0, 3), Mesh((2,), ("b",), (2, 3)), [Replicate()])
    for planner in PLANNERS:
        plan = planner(src, dst)
        assert all(not pieces for pieces in plan.phases)
        out = execute_transfer(plan, {0: np.zeros((0, 3)), 1: np.zeros((0, 3))})
        assert out[2].shape == (0, 3)
    scalar_src = Layout((), Mesh((2,), ("a",)), [Replicate()])
    scalar_dst = Layout((), Mesh((1,), ("b",), (5,)), [Replicate()])
    plan = plan_transfer(scalar_src, scalar_dst)
    assert plan.phases == ((Piece(0, 5, ()),),)
    out = execute_transfer(plan, {0: np.array(3.5), 1: np.array(3.5)})
    assert out[5].shape == ()
    assert out[5] == 3.5


# local_index_runs -------------------------------------------------------------------------------


def test_local_index_runs_by_hand() -> None:
    region = Region(((2, 6), (0, 4)))  # a 4 x 4 local block
    assert local_index_runs(region, ((3, 5), (1, 3))) == ((5, 2), (9, 2))
    assert local_index_runs(region, ((3, 5), (0, 4))) == ((4, 8),)
    assert local_index_runs(region, ((3, 3), (0, 4))) == ()
    flat = Region(((0, 2), (0, 3)), (2, 5))  # holds flat 2, 3, 4: (0, 2), (1, 0), (1, 1)
    assert local_index_runs(flat, ((1, 2), (0, 2))) == ((1, 2),)
    assert local_index_runs(flat, ((0, 1), (2, 3))) == ((0, 1),)
    assert local_index_runs(Region(()), ()) == ((0, 1),)


@given(st.data())
def test_local_index_runs_locate_every_element(data: st.DataObject) -> None:
    shape = data.draw(shapes(max_dims=3, max_size=5))
    mesh = data.draw(meshes(max_axes=2, max_size=3, max_ranks=6))
    layout = data.draw(layouts(mesh, shape, allow_partial=False))
    rank = data.draw(st.sampled_from(mesh.ranks))
    region = layout.local_region(rank)
    local = _slice(_ids(shape), region).reshape(-1)
    position = {int(v): i for i, v in enumerate(local)}
    cut = tuple(
        sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2))) for n in shape
    )
    for whole in region.boxes():
        box = tuple(
            (max(a, c), max(max(a, c), min(b, d)))
            for (a, b), (c, d) in zip(whole, cut, strict=True)
        )
        runs = local_index_runs(region, box)
        found = [i for start, length in runs for i in range(start, start + length)]
        assert found == [position[g] for g in _box_ids(shape, box)]
        assert all(n > 0 for _, n in runs)
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))


def test_local_index_runs_refuse_a_box_outside_the_region() -> None:
    flat = Region(((0, 2), (0, 3)), (2, 5))
    with pytest.raises(RedistributionError, match="local indices"):
        local_index_runs(flat, ((0, 1), (0, 1)))
    with pytest.raises(RedistributionError, match="leaves"):
        local_index_runs(Region(((2, 6), (0, 4))), ((1, 3), (0, 4)))
    with pytest.raises(RedistributionError, match="dims"):
        local_index_runs(Region(((2, 6), (0, 4))), ((2, 3),))


# Errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("planner", PLANNERS)
def test_refusals(planner: Any) -> None:
    mesh = Mesh((2,), ("a",))
    with pytest.raises(RedistributionError, match="global shapes"):
        planner(Layout((4,), mesh, [Shard(0)]), Layout((5,), mesh, [Shard(0)]))
    with pytest.raises(RedistributionError, match="reduction is not a transfer"):
        planner(Layout((4,), mesh, [Partial()]), Layout((4,), mesh, [Shard(0)]))
    with pytest.raises(RedistributionError, match=r"destination layout .* Partial"):
        planner(Layout((4,), mesh, [Shard(0)]), Layout((4,), mesh, [Partial("max")]))
    far = Layout((4,), Mesh((2,), ("b",), (7, 9)), [Shard(0)])
    with pytest.raises(RedistributionError, match=r"ranks \[9\] lie outside topology"):
        planner(Layout((4,), mesh, [Shard(0)]), far, Topology.two_tier_cluster(2, 4))


def test_bad_ranks_and_phases() -> None:
    src = Layout((4,), Mesh((2,), ("a",)), [Shard(0)])
    dst = Layout((4,), Mesh((2,), ("b",), (2, 3)), [Shard(0)])
    plan = plan_full_gather_transfer(src, dst)
    with pytest.raises(RedistributionError, match="rank 7 is in neither"):
        plan.receives(7, 0)
    with pytest.raises(RedistributionError, match="rank 7 is in neither"):
        plan.sends(7, 1)
    with pytest.raises(RedistributionError, match=r"phase 2 is outside .* \[0, 2\)"):
        plan.receives(0, 2)
    with pytest.raises(RedistributionError, match="rank 2 fills no buffer in phase 0"):
        plan.receive_region(2, 0)
    with pytest.raises(RedistributionError, match="rank 2 holds no source shard"):
        plan.send_region(2, 0)
    assert plan.receives(0, 1) == ()  # a source-only rank takes part but receives nothing
    with pytest.raises(RedistributionError, match="spans both meshes"):
        plan.elements_by_tier(Topology.single_host(3))
    with pytest.raises(RedistributionError, match="unknown transfer method"):
        TransferPlan(src, dst, ((),), "broadcast")


class _OverlappingLayout(Layout):
    """A layout whose ranks claim overlapping (or too few) elements: a broken source."""

    gap = False

    def local_region(self, rank: int) -> Region:
        if self.gap:
            return Region(((0, 1),)) if rank == 0 else Region(((2, 3),))
        return Region(((0, 2),)) if rank == 0 else Region(((1, 3),))


def test_sources_that_do_not_tile_the_tensor_are_refused() -> None:
    dst = Layout((3,), Mesh((1,), ("b",), (4,)), [Replicate()])
    broken = _OverlappingLayout((3,), Mesh((2,), ("overlap",)), [Shard(0)])
    with pytest.raises(RedistributionError, match="overlapping regions"):
        plan_transfer(broken, dst)

    class _Gap(_OverlappingLayout):
        gap = True

    holey = _Gap((3,), Mesh((2,), ("gap",)), [Shard(0)])
    with pytest.raises(RedistributionError, match="holds 2 distinct elements of the 3"):
        plan_full_gather_transfer(holey, dst)
