"""Postconditions of the pure Muon planner, checked over whole families of layouts.

No torch and no processes: layouts of up to 64 ranks (flat FSDP buffers, row/column TP, HSDP,
FSDP x TP, uneven and empty shards, expert stacks, row blocks) are planned and every
postcondition of :func:`plan_muon_step` and :func:`rank_program` is checked element by element.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest

from hp_layout import Layout, Mesh, Partial, RaggedShard, Replicate, Shard, plan_flat_buffer
from hp_layout.region import Box, box_intersection, box_numel
from hp_muon.plan import (
    MatrixTensor,
    MuonPlan,
    MuonPlanError,
    Piece,
    matrix_boxes,
    newton_schulz_cost,
    plan_muon_step,
    rank_program,
)

SHAPES: tuple[tuple[int, ...], ...] = (
    (18, 8),
    (3, 8),
    (8, 18),
    (12, 20),
    (20, 12),
    (1, 5),
    (3, 6, 4),
    (2, 3),
)


def _mesh(shape: Sequence[int], names: Sequence[str]) -> Mesh:
    return Mesh(tuple(shape), tuple(names), tuple(range(math.prod(shape))))


def _family(name: str, world: int) -> list[MatrixTensor]:
    """The layouts that each sharder gives the parameters of :data:`SHAPES` on ``world`` ranks."""
    if name == "flat":
        mesh = _mesh((world,), ("shard",))
        flat = plan_flat_buffer(SHAPES, world)
        return [MatrixTensor(flat.layout(i, mesh, "shard")) for i in range(len(SHAPES))]
    if name == "row_col":
        mesh = _mesh((world,), ("tp",))
        return [
            MatrixTensor(Layout(s, mesh, [Shard(len(s) - 2 + i % 2)])) for i, s in enumerate(SHAPES)
        ]
    if name == "replicate":
        mesh = _mesh((world,), ("dp",))
        return [MatrixTensor(Layout(s, mesh, [Replicate()])) for s in SHAPES]
    half = world // 2
    if name == "hsdp":
        mesh = _mesh((2, half), ("replicate", "shard"))
        return [MatrixTensor(Layout(s, mesh, [Replicate(), Shard(len(s) - 2)])) for s in SHAPES]
    if name == "fsdp_x_tp":
        mesh = _mesh((2, half), ("dp", "tp"))
        return [
            MatrixTensor(Layout(s, mesh, [Shard(len(s) - 2), Shard(len(s) - 1)])) for s in SHAPES
        ]
    if name == "nested_rows":
        # Both axes shard the rows, the second one first (shard order).
        mesh = _mesh((2, half), ("dp", "tp"))
        return [
            MatrixTensor(
                Layout(s, mesh, [Shard(len(s) - 2), Shard(len(s) - 2)], shard_order=("tp", "dp"))
            )
            for s in SHAPES
        ]
    if name == "hsdp_flat":
        mesh = _mesh((2, half), ("replicate", "shard"))
        flat = plan_flat_buffer(SHAPES, half)
        return [
            MatrixTensor(
                Layout(
                    s,
                    mesh,
                    [
                        Replicate(),
                        flat.layout(i, mesh.submesh("shard", rank=0), "shard").placements[0],
                    ],
                )
            )
            for i, s in enumerate(SHAPES)
        ]
    if name == "experts":
        # Expert stacks sharded on the expert dim (expert parallel) and on rows.
        mesh = _mesh((world,), ("ep",))
        return [
            MatrixTensor(Layout((world + 1, 6, 4), mesh, [Shard(0)])),
            MatrixTensor(Layout((3, 10, 6), mesh, [Shard(1)])),
        ]
    if name == "row_blocks":
        mesh = _mesh((world,), ("tp",))
        return [
            MatrixTensor(Layout((16, 8), mesh, [Shard(0)]), row_blocks=(8, 4, 4)),
            MatrixTensor(Layout((2, 12, 6), mesh, [Shard(2)]), row_blocks=(3, 3, 3, 3)),
            MatrixTensor(
                plan_flat_buffer([(16, 8)], world).layout(0, mesh, "tp"), row_blocks=(4, 12)
            ),
        ]
    raise AssertionError(name)


FAMILIES = (
    "flat",
    "row_col",
    "replicate",
    "hsdp",
    "fsdp_x_tp",
    "nested_rows",
    "hsdp_flat",
    "experts",
    "row_blocks",
)
CASES = [(f, w) for f in FAMILIES for w in (2, 4, 6, 64) if w % 2 == 0]


def _cells(piece: Piece, job_box: Box) -> set[tuple[int, int]]:
    (r0, r1), (c0, c1) = piece.rows, piece.cols
    assert 0 <= r0 < r1 <= job_box[-2][1] - job_box[-2][0]
    assert 0 <= c0 < c1 <= job_box[-1][1] - job_box[-1][0]
    return set(itertools.product(range(r0, r1), range(c0, c1)))


def _tiles(pieces: Iterable[Piece], box: Box) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for p in pieces:
        counts.update(_cells(p, box))
    return counts


def _whole(box: Box) -> set[tuple[int, int]]:
    (r0, r1), (c0, c1) = box[-2], box[-1]
    return set(itertools.product(range(r1 - r0), range(c1 - c0)))


def _check_piece_location(layout: Layout, piece: Piece, box: Box) -> None:
    """The piece's run is in the rank's local data; its selection is the piece's cells."""
    assert piece.start + piece.run_numel <= layout.local_numel(piece.rank)
    sel_numel = math.prod(b - a for a, b in piece.select)
    assert sel_numel == piece.numel
    assert all(0 <= a <= b <= n for (a, b), n in zip(piece.select, piece.run_shape, strict=True))
    # The selected rows/cols, shifted back, lie inside the matrix box.
    assert piece.select[-2][1] - piece.select[-2][0] == piece.rows[1] - piece.rows[0]
    assert piece.select[-1][1] - piece.select[-1][0] == piece.cols[1] - piece.cols[0]


def _check_plan(tensors: Sequence[MatrixTensor], plan: MuonPlan, bucket_numel: int) -> None:
    # Every non-empty matrix is one job, in parameter order then matrix order.
    expected = [
        (t, i, box)
        for t, spec in enumerate(tensors)
        for i, box in enumerate(matrix_boxes(spec.layout.global_shape, spec.row_blocks))
        if box_numel(box)
    ]
    assert [(j.tensor, j.index, j.box) for j in plan.jobs] == expected
    for job in plan.jobs:
        layout = tensors[job.tensor].layout
        holders = layout.ranks_holding(job.box)
        assert job.owner in holders
        # Sources come from the owner's shard group and tile the matrix exactly once.
        group = set(layout.shard_group(job.owner))
        assert {p.rank for p in job.sources} <= group
        assert _tiles(job.sources, job.box) == Counter(dict.fromkeys(_whole(job.box), 1))
        # Targets: every holder, each rank's pieces tiling exactly its share of the matrix.
        assert {p.rank for p in job.targets} == set(holders)
        for rank in holders:
            mine = [p for p in job.targets if p.rank == rank]
            share = Counter[tuple[int, int]]()
            for _, run in _run_boxes(layout, rank):
                inter = box_intersection(run, job.box)
                if box_numel(inter):
                    share.update(
                        itertools.product(
                            range(inter[-2][0] - job.box[-2][0], inter[-2][1] - job.box[-2][0]),
                            range(inter[-1][0] - job.box[-1][0], inter[-1][1] - job.box[-1][0]),
                        )
                    )
            assert _tiles(mine, job.box) == share
            for p in mine:
                _check_piece_location(layout, p, job.box)
        # A rank's replicas hold the same data: the targets cover the matrix once per replica.
        copies = len(layout.replica_group(job.owner))
        assert sum(p.numel for p in job.targets) == copies * job.numel
    # Buckets partition the jobs in order; a bucket exceeds the cap only with one matrix.
    assert [j for b in plan.buckets for j in b] == list(range(len(plan.jobs)))
    for bucket in plan.buckets:
        size = sum(plan.jobs[j].numel for j in bucket)
        assert size <= bucket_numel or len(bucket) == 1
    for first, second in itertools.pairwise(plan.buckets):
        # Greedy: the next bucket's first matrix did not fit in the previous one.
        size = sum(plan.jobs[j].numel for j in first)
        assert size + plan.jobs[second[0]].numel > bucket_numel
    assert plan.ranks == tuple(sorted({p.rank for j in plan.jobs for p in j.targets}))


def _run_boxes(layout: Layout, rank: int) -> list[tuple[int, Box]]:
    region = layout.local_region(rank)
    if region.flat is None:
        return [(0, region.box)] if region.numel else []
    return [(0, box) for box in region.boxes()]


def _check_balance(tensors: Sequence[MatrixTensor], plan: MuonPlan) -> None:
    """LPT: when a job was assigned, its owner had the least load among its candidates.

    Replaying the greedy order (decreasing cost), each owner's load before the assignment is at
    most every other candidate's, and the replayed loads are the plan's.
    """
    order = sorted(plan.jobs, key=lambda j: (-j.cost, j.tensor, j.index))
    load: Counter[int] = Counter()
    for job in order:
        candidates = tensors[job.tensor].layout.ranks_holding(job.box)
        assert all(load[job.owner] <= load[c] for c in candidates)
        load[job.owner] += job.cost
    assert dict(load) == {r: c for r, c in plan.load().items() if c}


def _check_programs(plan: MuonPlan, world: int) -> None:
    group = tuple(range(world))
    programs = [rank_program(plan, r, group) for r in group]
    for b in range(len(plan.buckets)):
        for phase in ("gather", "scatter"):
            for a, c in itertools.product(group, group):
                if a == c:
                    continue
                sends = [
                    (t.job, t.piece)
                    for t in getattr(programs[a].buckets[b], f"{phase}_sends")
                    if t.peer == c
                ]
                recvs = [
                    (t.job, t.piece)
                    for t in getattr(programs[c].buckets[b], f"{phase}_recvs")
                    if t.peer == a
                ]
                assert sends == recvs, (phase, a, c)
            for prog in programs:
                bucket = prog.buckets[b]
                send_splits, recv_splits = getattr(bucket, f"{phase}_splits")
                for kind, splits in (("sends", send_splits), ("recvs", recv_splits)):
                    transfers = getattr(bucket, f"{phase}_{kind}")
                    # Offsets are contiguous in wire order, grouped by ascending peer.
                    offset = 0
                    for t in transfers:
                        assert t.offset == offset
                        offset += t.piece.numel
                    assert [t.peer for t in transfers] == sorted(t.peer for t in transfers)
                    assert sum(splits) == offset
                    for peer in group:
                        assert splits[peer] == sum(
                            t.piece.numel for t in transfers if t.peer == peer
                        )
    # Every matrix is orthogonalized by exactly one rank.
    owned = Counter(j for p in programs for b in p.buckets for j in b.owned)
    assert owned == Counter(range(len(plan.jobs)))
    # The counts per rank add up to the plan's totals, and neither phase moves more than the
    # job holds in all (a piece crosses at most once each way).
    gathered, scattered = plan.elements_moved()
    assert sum(sum(b.gather_splits[0]) for p in programs for b in p.buckets) == gathered
    assert sum(sum(b.scatter_splits[0]) for p in programs for b in p.buckets) == scattered
    held = sum(p.numel for j in plan.jobs for p in j.targets)
    assert gathered <= held
    assert scattered <= held


@pytest.mark.parametrize(("family", "world"), CASES)
@pytest.mark.parametrize("bucket_numel", [1, 100, 10**6])
def test_plan_postconditions(family: str, world: int, bucket_numel: int) -> None:
    tensors = _family(family, world)
    plan = plan_muon_step(tensors, bucket_numel=bucket_numel)
    _check_plan(tensors, plan, bucket_numel)
    _check_balance(tensors, plan)
    if world <= 6:
        _check_programs(plan, world)
    assert plan_muon_step(tensors, bucket_numel=bucket_numel) == plan


@pytest.mark.parametrize("world", [2, 4, 8])
def test_programs_of_large_flat_world_match_pairwise(world: int) -> None:
    """Uneven chunks cut through rows and matrices: every send meets its receive."""
    tensors = _family("flat", world)
    _check_programs(plan_muon_step(tensors, bucket_numel=64), world)


def test_replicated_layout_moves_nothing_to_gather() -> None:
    """DDP: every rank holds every matrix; the owner gathers nothing, results go to all."""
    tensors = _family("replicate", 4)
    plan = plan_muon_step(tensors, bucket_numel=10**6)
    gathered, scattered = plan.elements_moved()
    assert gathered == 0
    assert scattered == 3 * sum(j.numel for j in plan.jobs)
    # The work is spread over the replicas rather than repeated.
    assert len({j.owner for j in plan.jobs}) == 4


def test_hsdp_owner_gathers_from_its_own_replica() -> None:
    tensors = _family("hsdp", 8)
    plan = plan_muon_step(tensors, bucket_numel=10**6)
    for job in plan.jobs:
        half = job.owner // 4
        assert all(p.rank // 4 == half for p in job.sources)
    # Both replicas own matrices: the two copies share the Newton-Schulz work.
    assert {j.owner // 4 for j in plan.jobs} == {0, 1}


def test_lpt_balances_equal_matrices_evenly() -> None:
    """64 equal replicated matrices on 8 ranks: 8 each."""
    mesh = _mesh((8,), ("dp",))
    tensors = [MatrixTensor(Layout((16, 16), mesh, [Replicate()])) for _ in range(64)]
    load = plan_muon_step(tensors, bucket_numel=10**6).load()
    assert set(load.values()) == {8 * newton_schulz_cost(16, 16)}


def test_owner_prefers_the_rank_holding_most() -> None:
    """Equal loads: the rank holding 12 of the 16 elements owns the matrix, not rank 0."""
    mesh = _mesh((2,), ("shard",))
    layout = Layout((4, 4), mesh, [RaggedShard((4, 12))])
    plan = plan_muon_step([MatrixTensor(layout)], bucket_numel=100)
    assert plan.jobs[0].owner == 1
    assert plan.elements_moved() == (4, 4)


def test_empty_shards_and_empty_matrices() -> None:
    """A (1, 5) matrix on 4 ranks leaves 3 ranks empty; a (0, 5) parameter has no matrix."""
    mesh = _mesh((4,), ("tp",))
    tensors = [
        MatrixTensor(Layout((1, 5), mesh, [Shard(0)])),
        MatrixTensor(Layout((0, 5), mesh, [Shard(0)])),
    ]
    plan = plan_muon_step(tensors, bucket_numel=100)
    assert len(plan.jobs) == 1
    assert plan.jobs[0].owner == 0
    assert plan.ranks == (0,)
    assert not plan.exchanges


def test_matrix_boxes_cover_the_tensor_once() -> None:
    for shape, blocks in [((4, 6), None), ((2, 3, 6, 4), (2, 4)), ((5, 3), (1, 1, 3))]:
        boxes = matrix_boxes(shape, blocks)
        cells: Counter[tuple[int, ...]] = Counter()
        for box in boxes:
            assert all(b - a == 1 for a, b in box[:-2])
            assert box[-1] == (0, shape[-1])
            cells.update(itertools.product(*(range(a, b) for a, b in box)))
        assert cells == Counter(itertools.product(*(range(n) for n in shape)))
        assert len(boxes) == math.prod(shape[:-2]) * len(blocks or (1,))


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (MatrixTensor(Layout((6,), _mesh((2,), ("dp",)), [Shard(0)])), "fewer than 2 dims"),
        (
            MatrixTensor(Layout((6, 4), _mesh((2,), ("dp",)), [Shard(0)]), row_blocks=(2, 2)),
            "summing to the 6 rows",
        ),
        (
            MatrixTensor(Layout((6, 4), _mesh((2,), ("dp",)), [Shard(0)]), row_blocks=(0, 6)),
            "positive sizes",
        ),
        (MatrixTensor(Layout((6, 4), _mesh((2,), ("dp",)), [Partial()])), "Partial placement"),
    ],
)
def test_plan_errors(tensor: MatrixTensor, message: str) -> None:
    with pytest.raises(MuonPlanError, match=message):
        plan_muon_step([tensor], bucket_numel=100)


def test_bucket_numel_must_be_positive() -> None:
    with pytest.raises(MuonPlanError, match="bucket_numel must be positive"):
        plan_muon_step([], bucket_numel=0)


def test_rank_program_names_ranks_outside_the_group() -> None:
    plan = plan_muon_step(_family("row_col", 4), bucket_numel=100)
    with pytest.raises(MuonPlanError, match=r"ranks \[2, 3\] hold Muon parameters"):
        rank_program(plan, 0, (0, 1))


def test_ragged_layout_pieces_follow_flat_runs() -> None:
    """A RaggedShard cut in the middle of a row gives a rank several runs of one matrix."""
    mesh = _mesh((2,), ("shard",))
    layout = Layout((3, 4), mesh, [RaggedShard((5, 7))])
    plan = plan_muon_step([MatrixTensor(layout)], bucket_numel=100)
    (job,) = plan.jobs
    rank1 = [p for p in job.targets if p.rank == 1]
    # Rank 1 holds elements 5..11: the rest of row 1 (cols 1-3) and row 2.
    assert sorted((p.rows, p.cols, p.start) for p in rank1) == [
        ((1, 2), (1, 4), 0),
        ((2, 3), (0, 4), 3),
    ]
