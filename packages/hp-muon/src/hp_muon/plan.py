"""Planning a distributed Muon step: pure functions from layouts to an immutable plan.

Every parameter handed to Muon is one or more *matrices*: a 2-D parameter is one, an
``[E, out, in]`` parameter is ``E`` (one per leading index), and row blocks (a fused QKV
weight split into its Q, K and V rows, or per-head blocks) cut each of those further. The
layout of the parameter (``hp_dtensor.layout_of``) says which ranks hold which elements of each
matrix. From that alone, every rank computes the same plan:

* **owner**: each matrix gets exactly one owner among the ranks holding any of it, chosen
  longest-processing-time first (matrices in decreasing Newton-Schulz cost, each to the
  candidate with the least cost so far), so that the per-rank work is balanced and replicas
  never redo each other's work;
* **sources**: the pieces the owner gathers, from the ranks of its own copy (its shard group:
  the ranks that vary the sharding axes at the owner's replica coordinate); they tile the
  matrix;
* **targets**: every rank's pieces of the matrix; each gets its part of the result back;
* **buckets**: consecutive matrices grouped up to a size, each bucket one exchange each way.

:func:`rank_program` then turns the plan into what one rank sends, receives and computes,
in wire order, for the executor (:mod:`hp_muon.exchange`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hp_layout import Layout, Partial
from hp_layout.region import Box, box_intersection, box_numel

__all__ = [
    "BucketProgram",
    "MatrixJob",
    "MatrixTensor",
    "MuonPlan",
    "MuonPlanError",
    "Piece",
    "RankProgram",
    "Transfer",
    "matrix_boxes",
    "newton_schulz_cost",
    "plan_muon_step",
    "rank_program",
]


class MuonPlanError(ValueError):
    """A parameter cannot be planned (its layout or its row blocks do not fit Muon)."""


@dataclass(frozen=True)
class MatrixTensor:
    """One parameter as the planner sees it.

    Attributes:
        layout: the parameter's layout (global shape with at least 2 dims, mesh, placements).
        row_blocks: sizes of the row blocks each matrix is cut into (summing to the matrix's
            rows), or ``None`` for whole matrices.
    """

    layout: Layout
    row_blocks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Piece:
    """The part of one matrix that one rank holds, and where it is in that rank's local data.

    A rank's local data is viewed flat; the piece lies in one contiguous *run* of it: the
    whole local box, or one box of a flat ``RaggedShard`` range.

    Attributes:
        rank: the global rank holding the piece.
        start: flat offset of the run in the rank's local data.
        run_shape: the run's shape as a box of the global tensor (one extent per dim).
        select: the piece inside the run: one ``(start, stop)`` per dim, relative to the run.
        rows: the piece's ``(start, stop)`` rows in the matrix.
        cols: the piece's ``(start, stop)`` columns in the matrix.
    """

    rank: int
    start: int
    run_shape: tuple[int, ...]
    select: Box
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])

    @property
    def run_numel(self) -> int:
        """Number of elements of the run the piece lies in."""
        return math.prod(self.run_shape)


@dataclass(frozen=True)
class MatrixJob:
    """One matrix: where it is, who orthogonalizes it, who sends and receives which piece.

    Attributes:
        tensor: index of its parameter in the list given to :func:`plan_muon_step`.
        index: its index among that parameter's matrices (leading indices row-major, then row
            blocks).
        box: its box in the parameter's global index space (extent 1 on leading dims).
        owner: the global rank that gathers, orthogonalizes and scatters it.
        sources: the pieces the owner gathers (from its shard group); they tile the matrix.
        targets: every holder's pieces, in mesh rank order; each receives its part of the
            result.
    """

    tensor: int
    index: int
    box: Box
    owner: int
    sources: tuple[Piece, ...]
    targets: tuple[Piece, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix."""
        (r0, r1), (c0, c1) = self.box[-2], self.box[-1]
        return (r1 - r0, c1 - c0)

    @property
    def numel(self) -> int:
        """Number of elements of the matrix."""
        rows, cols = self.shape
        return rows * cols

    @property
    def cost(self) -> int:
        """Newton-Schulz cost in multiply-adds per step (see :func:`newton_schulz_cost`)."""
        return newton_schulz_cost(*self.shape)


@dataclass(frozen=True)
class MuonPlan:
    """Every matrix of a step, with owners, pieces and buckets.

    Attributes:
        jobs: the matrices, in parameter order then matrix order (empty matrices omitted).
        buckets: consecutive runs of job indices; each bucket is one exchange each way.
        ranks: every global rank that holds a piece of some matrix, ascending.
    """

    jobs: tuple[MatrixJob, ...]
    buckets: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]

    def load(self) -> dict[int, int]:
        """Newton-Schulz cost owned by each rank of :attr:`ranks` (0 for ranks owning none)."""
        out = dict.fromkeys(self.ranks, 0)
        for job in self.jobs:
            out[job.owner] += job.cost
        return out

    def elements_moved(self) -> tuple[int, int]:
        """Elements crossing between ranks per step: ``(gathered, scattered)``."""
        gathered = sum(p.numel for j in self.jobs for p in j.sources if p.rank != j.owner)
        scattered = sum(p.numel for j in self.jobs for p in j.targets if p.rank != j.owner)
        return gathered, scattered

    @property
    def exchanges(self) -> bool:
        """Whether any piece crosses ranks (a plan of single-rank layouts never does)."""
        return any(p.rank != j.owner for j in self.jobs for p in (*j.sources, *j.targets))


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz step on a ``rows x cols`` matrix.

    With ``m = min``, ``n = max``: the Gram matrix ``X X^T`` costs ``m*m*n``, the update
    ``b A + c A A`` costs ``m^3``, applying it costs ``m*m*n``.
    """
    m, n = min(rows, cols), max(rows, cols)
    return 2 * m * m * n + m**3


def matrix_boxes(shape: Sequence[int], row_blocks: Sequence[int] | None = None) -> tuple[Box, ...]:
    """The boxes of the matrices of a parameter of ``shape``: one per leading index (row-major),
    each cut into ``row_blocks`` along the rows.

    Postconditions: the boxes are disjoint, cover the whole tensor, have extent 1 on every
    leading dim and the full column range; there are ``prod(shape[:-2]) * len(row_blocks)``.

    Raises:
        MuonPlanError: ``shape`` has fewer than 2 dims, or ``row_blocks`` has a non-positive size
            or does not sum to ``shape[-2]``.
    """
    dims = tuple(int(s) for s in shape)
    if len(dims) < 2:
        raise MuonPlanError(
            f"Muon orthogonalizes matrices; a parameter of shape {dims} has fewer than 2 dims "
            "(optimize it with AdamW, see hp_muon.split_params)"
        )
    rows, cols = dims[-2], dims[-1]
    if row_blocks is None:
        blocks: tuple[int, ...] = (rows,) if rows else ()
    else:
        blocks = tuple(int(b) for b in row_blocks)
    if any(b <= 0 for b in blocks) or sum(blocks) != rows:
        raise MuonPlanError(
            f"row blocks {blocks} must be positive sizes summing to the {rows} rows of each "
            f"matrix of a parameter of shape {dims}"
        )
    row_ranges: list[tuple[int, int]] = []
    start = 0
    for b in blocks:
        row_ranges.append((start, start + b))
        start += b
    out: list[Box] = []
    for lead in _leading_indices(dims[:-2]):
        lead_box = tuple((i, i + 1) for i in lead)
        out.extend((*lead_box, r, (0, cols)) for r in row_ranges)
    return tuple(out)


def _leading_indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [(*prefix, i) for prefix in out for i in range(n)]
    return out


def _runs(layout: Layout, rank: int) -> list[tuple[int, Box]]:
    """``(flat start, box)`` of the contiguous runs of ``rank``'s local data."""
    region = layout.local_region(rank)
    if region.flat is None:
        return [(0, region.box)] if region.numel else []
    out: list[tuple[int, Box]] = []
    start = 0
    for box in region.boxes():
        out.append((start, box))
        start += box_numel(box)
    return out


def _pieces(layout: Layout, rank: int, box: Box) -> list[Piece]:
    out: list[Piece] = []
    (r0, _), (c0, _) = box[-2], box[-1]
    for start, run in _runs(layout, rank):
        inter = box_intersection(run, box)
        if not box_numel(inter):
            continue
        select = tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(inter, run, strict=True))
        (a, b), (c, d) = inter[-2], inter[-1]
        out.append(
            Piece(
                rank=rank,
                start=start,
                run_shape=tuple(hi - lo for lo, hi in run),
                select=select,
                rows=(a - r0, b - r0),
                cols=(c - c0, d - c0),
            )
        )
    return out


def _check_layout(layout: Layout, where: str) -> None:
    if any(isinstance(p, Partial) for p in layout.placements):
        raise MuonPlanError(
            f"{where}: layout {layout!r} has a Partial placement; Muon needs the reduced "
            "gradient laid out like its parameter (reduce it before the step)"
        )


def plan_muon_step(tensors: Sequence[MatrixTensor], *, bucket_numel: int) -> MuonPlan:
    """Plan one Muon step over ``tensors`` (see the module doc).

    Owners: jobs are taken in decreasing :attr:`MatrixJob.cost` (ties: parameter order, then
    matrix order); each goes to the candidate (a rank holding at least one of its elements)
    with the least cost assigned so far, ties broken by the most elements held, then the lowest
    rank. Buckets: jobs in parameter order, a new bucket starting when the next matrix would
    take the bucket past ``bucket_numel`` elements (a bucket holds at least one matrix).

    Postconditions: every non-empty matrix is one job with one owner, who holds some of it; a
    job's sources are held by the owner's shard group and tile the matrix; its targets are
    every holder's pieces, each rank's tiling its share; buckets partition the jobs in order.
    The plan depends only on the arguments (every rank computes the same one).

    Raises:
        MuonPlanError: a layout has a Partial placement or fewer than 2 dims, or its row blocks
            do not fit.
    """
    if bucket_numel <= 0:
        raise MuonPlanError(f"bucket_numel must be positive, got {bucket_numel}")
    boxes: list[tuple[int, int, Box]] = []
    for t, spec in enumerate(tensors):
        _check_layout(spec.layout, f"parameter {t}")
        for i, box in enumerate(matrix_boxes(spec.layout.global_shape, spec.row_blocks)):
            if box_numel(box):
                boxes.append((t, i, box))

    def cost(entry: tuple[int, int, Box]) -> int:
        box = entry[2]
        return newton_schulz_cost(box[-2][1] - box[-2][0], box[-1][1] - box[-1][0])

    load: dict[int, int] = {}
    owners: dict[tuple[int, int], int] = {}
    for t, i, box in sorted(boxes, key=lambda e: (-cost(e), e[0], e[1])):
        layout = tensors[t].layout
        candidates = layout.ranks_holding(box)
        held = {r: sum(p.numel for p in _pieces(layout, r, box)) for r in candidates}
        owner = min(candidates, key=lambda r: (load.get(r, 0), -held[r], r))
        owners[(t, i)] = owner
        load[owner] = load.get(owner, 0) + cost((t, i, box))

    jobs: list[MatrixJob] = []
    for t, i, box in boxes:
        layout = tensors[t].layout
        owner = owners[(t, i)]
        sources = tuple(p for r in layout.shard_group(owner) for p in _pieces(layout, r, box))
        targets = tuple(p for r in layout.mesh.ranks for p in _pieces(layout, r, box))
        jobs.append(MatrixJob(t, i, box, owner, sources, targets))

    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for j, job in enumerate(jobs):
        if current and size + job.numel > bucket_numel:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(j)
        size += job.numel
    if current:
        buckets.append(tuple(current))
    ranks = sorted({p.rank for job in jobs for p in job.targets})
    return MuonPlan(tuple(jobs), tuple(buckets), tuple(ranks))


# Per-rank programs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One piece on the wire, seen from one rank.

    Attributes:
        job: index of the matrix in :attr:`MuonPlan.jobs`.
        piece: the piece (its ``rank`` holds it in the parameter's layout).
        peer: the group rank on the other side (receiver of a send, sender of a receive).
        offset: the piece's first element in this rank's send or receive buffer.
    """

    job: int
    piece: Piece
    peer: int
    offset: int


@dataclass(frozen=True)
class BucketProgram:
    """What one rank does for one bucket.

    Attributes:
        gather_sends: pieces of matrices owned elsewhere that this rank sends to the owner.
        gather_recvs: pieces of this rank's matrices that it receives from their holders.
        gather_splits: ``(send, receive)`` element counts per group rank.
        gather_exchange: whether any rank moves anything in the gather (the same on all ranks).
        owned: jobs this rank orthogonalizes, in job order.
        own_sources: ``(job, piece)`` of owned jobs that this rank holds itself.
        scatter_sends: result pieces of owned jobs that go to their holders.
        scatter_recvs: result pieces of this rank's share that it receives from the owners.
        scatter_splits: ``(send, receive)`` element counts per group rank.
        scatter_exchange: whether any rank moves anything in the scatter.
        own_targets: ``(job, piece)`` of owned jobs whose result this rank keeps itself.
    """

    gather_sends: tuple[Transfer, ...]
    gather_recvs: tuple[Transfer, ...]
    gather_splits: tuple[tuple[int, ...], tuple[int, ...]]
    gather_exchange: bool
    owned: tuple[int, ...]
    own_sources: tuple[tuple[int, Piece], ...]
    scatter_sends: tuple[Transfer, ...]
    scatter_recvs: tuple[Transfer, ...]
    scatter_splits: tuple[tuple[int, ...], tuple[int, ...]]
    scatter_exchange: bool
    own_targets: tuple[tuple[int, Piece], ...]


@dataclass(frozen=True)
class RankProgram:
    """One rank's part of a :class:`MuonPlan`.

    Attributes:
        rank: the global rank.
        group_ranks: global rank of each rank of the process group carrying the exchanges.
        buckets: one program per bucket of the plan.
    """

    rank: int
    group_ranks: tuple[int, ...]
    buckets: tuple[BucketProgram, ...]

    @property
    def orthogonalized(self) -> int:
        """Matrices this rank orthogonalizes per step."""
        return sum(len(b.owned) for b in self.buckets)

    @property
    def elements_sent(self) -> int:
        """Elements this rank sends per step (gather and scatter)."""
        return sum(sum(b.gather_splits[0]) + sum(b.scatter_splits[0]) for b in self.buckets)

    @property
    def collectives(self) -> int:
        """Exchanges (all-to-all calls) per step."""
        return sum(int(b.gather_exchange) + int(b.scatter_exchange) for b in self.buckets)


def _wire(
    entries: list[tuple[int, int, Piece]], size: int
) -> tuple[tuple[Transfer, ...], tuple[int, ...]]:
    """Order ``(peer, job, piece)`` entries by peer (stable) and give each its buffer offset."""
    ordered = sorted(enumerate(entries), key=lambda e: (e[1][0], e[0]))
    splits = [0] * size
    out: list[Transfer] = []
    offset = 0
    for _, (peer, job, piece) in ordered:
        out.append(Transfer(job, piece, peer, offset))
        offset += piece.numel
        splits[peer] += piece.numel
    return tuple(out), tuple(splits)


def rank_program(plan: MuonPlan, rank: int, group_ranks: Sequence[int]) -> RankProgram:
    """What ``rank`` sends, receives and orthogonalizes in each bucket of ``plan``.

    ``group_ranks[i]`` is the global rank of group rank ``i`` of the process group that carries
    the exchanges. Wire order: each buffer is grouped by peer (group rank order); within a
    peer, pieces follow job order, then piece order, on both sides.

    Postconditions: for every pair of ranks and bucket, the pieces one sends the other are
    exactly, in the same order, the pieces the other receives from it.

    Raises:
        MuonPlanError: a rank of the plan is not in ``group_ranks``.
    """
    index = {r: i for i, r in enumerate(group_ranks)}
    missing = [r for r in plan.ranks if r not in index]
    if missing:
        raise MuonPlanError(
            f"ranks {missing} hold Muon parameters but are not in the process group (ranks "
            f"{list(group_ranks)}); pass a process_group covering every parameter's mesh"
        )
    size = len(group_ranks)
    programs: list[BucketProgram] = []
    for bucket in plan.buckets:
        g_send: list[tuple[int, int, Piece]] = []
        g_recv: list[tuple[int, int, Piece]] = []
        s_send: list[tuple[int, int, Piece]] = []
        s_recv: list[tuple[int, int, Piece]] = []
        own_sources: list[tuple[int, Piece]] = []
        own_targets: list[tuple[int, Piece]] = []
        owned: list[int] = []
        gather_exchange = scatter_exchange = False
        for j in bucket:
            job = plan.jobs[j]
            gather_exchange |= any(p.rank != job.owner for p in job.sources)
            scatter_exchange |= any(p.rank != job.owner for p in job.targets)
            if job.owner == rank:
                owned.append(j)
            for p in job.sources:
                if p.rank == rank and job.owner == rank:
                    own_sources.append((j, p))
                elif p.rank == rank:
                    g_send.append((index[job.owner], j, p))
                elif job.owner == rank:
                    g_recv.append((index[p.rank], j, p))
            for p in job.targets:
                if p.rank == rank and job.owner == rank:
                    own_targets.append((j, p))
                elif p.rank == rank:
                    s_recv.append((index[job.owner], j, p))
                elif job.owner == rank:
                    s_send.append((index[p.rank], j, p))
        gather_sends, g_send_splits = _wire(g_send, size)
        gather_recvs, g_recv_splits = _wire(g_recv, size)
        scatter_sends, s_send_splits = _wire(s_send, size)
        scatter_recvs, s_recv_splits = _wire(s_recv, size)
        programs.append(
            BucketProgram(
                gather_sends=gather_sends,
                gather_recvs=gather_recvs,
                gather_splits=(g_send_splits, g_recv_splits),
                gather_exchange=gather_exchange,
                owned=tuple(owned),
                own_sources=tuple(own_sources),
                scatter_sends=scatter_sends,
                scatter_recvs=scatter_recvs,
                scatter_splits=(s_send_splits, s_recv_splits),
                scatter_exchange=scatter_exchange,
                own_targets=tuple(own_targets),
            )
        )
    return RankProgram(rank, tuple(group_ranks), tuple(programs))
