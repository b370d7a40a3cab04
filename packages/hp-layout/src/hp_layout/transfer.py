"""Transfer planning: move a tensor from one layout to another on a different mesh.

:func:`plan_redistribute` changes placements on one mesh through collectives. A transfer
instead joins two meshes that may share some, all or none of their ranks (a trainer's
FSDP x TP layout and an inference engine's TP layout, on the same or on other hosts): it is
a set of point-to-point :class:`Piece` s, each a box of global indices that one source rank
sends to one destination rank (or copies, when both are the same rank).

Two plans are built:

* :func:`plan_transfer` (``"direct"``, one phase): every destination rank receives exactly its
  region, each element once, from a source rank that holds it: itself when it does, otherwise
  the holder reached over the fastest tier, balanced between equally fast holders.
* :func:`plan_full_gather_transfer` (``"full_gather"``, two phases): what a trainer does
  without a planner, the baseline benchmarks compare with. Phase 0: every source rank
  assembles the whole tensor; phase 1: every destination rank takes its region from one
  source rank.

Which elements each plan moves per tier: ``direct`` never moves more elements in total than
``full_gather``, and no more on any tier when every destination rank outside the source mesh
reaches all source ranks over one tier (the same ranks on both sides, or a rollout on hosts
that hold no trainer rank). Otherwise it can move more over a slow tier: each remote
destination fetches its region over that tier, where ``full_gather`` fetches the tensor once
per source rank and fans it out over the fast tier.

Planning is pure; executors (:func:`hp_layout.reference.execute_transfer` on numpy, a torch
one with point-to-point sends) pack and unpack pieces with :func:`local_index_runs`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property, lru_cache

from hp_layout.errors import RedistributionError
from hp_layout.layout import Layout
from hp_layout.region import Box, Region, box_intersection, box_numel
from hp_layout.topology import Topology

__all__ = [
    "Piece",
    "TransferPlan",
    "local_index_runs",
    "plan_full_gather_transfer",
    "plan_transfer",
]

DIRECT = "direct"
FULL_GATHER = "full_gather"
_PHASES = {DIRECT: 1, FULL_GATHER: 2}


@dataclass(frozen=True, order=True)
class Piece:
    """One box of the global tensor that ``src_rank`` sends to ``dst_rank``.

    Attributes:
        src_rank: the rank that sends (reads the box from its send buffer).
        dst_rank: the rank that receives (writes the box into its receive buffer).
        box: global indices, non-empty; it lies inside the sender's send region and the
            receiver's receive region (see :meth:`TransferPlan.send_region`).
    """

    src_rank: int
    dst_rank: int
    box: Box

    @property
    def local(self) -> bool:
        """True when sender and receiver are the same rank: a copy, no communication."""
        return self.src_rank == self.dst_rank

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return box_numel(self.box)


def _whole(shape: tuple[int, ...]) -> Region:
    return Region(tuple((0, n) for n in shape))


@dataclass(frozen=True)
class TransferPlan:
    """Pieces that turn ``src`` shards into ``dst`` shards, in phases run one after another.

    Each rank keeps one buffer per phase it receives in. In phase 0 a rank sends from its
    ``src`` shard; in a later phase from the buffer it filled in the phase before. After the
    last phase every ``dst`` rank's buffer is its ``dst`` shard.

    Attributes:
        src: the layout the data starts in.
        dst: the layout it ends in (same global shape, any mesh).
        phases: pieces per phase, sorted by (receiver, sender, box); the pieces of one phase
            are independent (any order, concurrently).
        method: ``"direct"`` (one phase) or ``"full_gather"`` (two).

    Postconditions (of both planners): in every phase, the boxes each receiver gets are
    disjoint and together exactly its :meth:`receive_region`; each box lies inside the
    sender's :meth:`send_region`; a piece is local exactly when the receiver already holds
    the box in its send buffer for that phase.
    """

    src: Layout
    dst: Layout
    phases: tuple[tuple[Piece, ...], ...]
    method: str

    def __post_init__(self) -> None:
        if self.method not in _PHASES:
            raise RedistributionError(
                f"unknown transfer method {self.method!r}; use one of {sorted(_PHASES)}"
            )
        if len(self.phases) != _PHASES[self.method]:
            raise RedistributionError(
                f"a {self.method!r} transfer has {_PHASES[self.method]} phases, "
                f"got {len(self.phases)}"
            )

    # Who does what ----------------------------------------------------------------------------

    @cached_property
    def _ranks(self) -> frozenset[int]:
        return frozenset(self.src.mesh.ranks) | frozenset(self.dst.mesh.ranks)

    def _check_phase(self, phase: int) -> None:
        if not 0 <= phase < len(self.phases):
            raise RedistributionError(
                f"phase {phase} is outside this {self.method!r} plan's phases "
                f"[0, {len(self.phases)})"
            )

    def _check(self, rank: int, phase: int) -> None:
        self._check_phase(phase)
        if rank not in self._ranks:
            raise RedistributionError(
                f"rank {rank} is in neither the source mesh {self.src.mesh.ranks} nor the "
                f"destination mesh {self.dst.mesh.ranks} of this transfer"
            )

    def receivers(self, phase: int) -> tuple[int, ...]:
        """Ranks (ascending) that fill a buffer in ``phase``, whether or not they get data."""
        self._check_phase(phase)
        layout = self.src if self.method == FULL_GATHER and phase == 0 else self.dst
        return tuple(sorted(layout.mesh.ranks))

    def receive_region(self, rank: int, phase: int) -> Region:
        """The elements of the buffer ``rank`` fills in ``phase``.

        Its ``dst`` region in the last phase; the whole tensor in phase 0 of ``full_gather``.

        Raises:
            RedistributionError: when ``rank`` fills no buffer in ``phase``.
        """
        self._check(rank, phase)
        if rank not in self.receivers(phase):
            raise RedistributionError(
                f"rank {rank} fills no buffer in phase {phase} of this {self.method!r} plan; "
                f"the receivers are {self.receivers(phase)}"
            )
        if self.method == FULL_GATHER and phase == 0:
            return _whole(self.src.global_shape)
        return self.dst.local_region(rank)

    def send_region(self, rank: int, phase: int) -> Region:
        """The elements of the buffer ``rank`` sends from in ``phase``.

        Phase 0: its ``src`` region; later phases: the buffer it filled the phase before.

        Raises:
            RedistributionError: when ``rank`` holds no such buffer.
        """
        self._check(rank, phase)
        if phase == 0:
            if rank not in self.src.mesh:
                raise RedistributionError(
                    f"rank {rank} holds no source shard; the source mesh is {self.src.mesh.ranks}"
                )
            return self.src.local_region(rank)
        return self.receive_region(rank, phase - 1)

    @cached_property
    def _by_receiver(self) -> tuple[dict[int, tuple[Piece, ...]], ...]:
        out = []
        for pieces in self.phases:
            table: dict[int, list[Piece]] = {}
            for p in pieces:
                table.setdefault(p.dst_rank, []).append(p)
            out.append({r: tuple(sorted(ps, key=_receive_key)) for r, ps in table.items()})
        return tuple(out)

    @cached_property
    def _by_sender(self) -> tuple[dict[int, tuple[Piece, ...]], ...]:
        out = []
        for pieces in self.phases:
            table: dict[int, list[Piece]] = {}
            for p in pieces:
                table.setdefault(p.src_rank, []).append(p)
            out.append({r: tuple(sorted(ps, key=_send_key)) for r, ps in table.items()})
        return tuple(out)

    def receives(self, rank: int, phase: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` receives in ``phase``, sorted by (sender, box); local copies included.

        Between one sender and one receiver, :meth:`sends` lists the same boxes in the same
        order, so a message can be packed and unpacked box after box.
        """
        self._check(rank, phase)
        return self._by_receiver[phase].get(rank, ())

    def sends(self, rank: int, phase: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` sends in ``phase``, sorted by (receiver, box); local copies included."""
        self._check(rank, phase)
        return self._by_sender[phase].get(rank, ())

    # Accounting -------------------------------------------------------------------------------

    def elements_moved(self) -> int:
        """Elements received over all ranks and phases, local copies excluded."""
        return sum(p.numel for pieces in self.phases for p in pieces if not p.local)

    def elements_by_tier(self, topology: Topology) -> dict[str, int]:
        """Elements received over all ranks and phases per tier of ``topology`` (every tier
        listed); a piece crosses the tier of its two ranks; local copies are excluded."""
        _check_topology(topology, self._ranks)
        out = {t.name: 0 for t in topology.tiers}
        for pieces in self.phases:
            for p in pieces:
                if not p.local:
                    out[topology.tier_of_group((p.src_rank, p.dst_rank)).name] += p.numel
        return out

    def bytes_by_tier(self, topology: Topology, itemsize: int) -> dict[str, int]:
        """:meth:`elements_by_tier` times ``itemsize`` bytes per element."""
        return {k: v * itemsize for k, v in self.elements_by_tier(topology).items()}

    def __str__(self) -> str:
        lines = [f"{self.method} transfer {self.src!r} on {self.src.mesh.ranks} -> "]
        lines[0] += f"{self.dst!r} on {self.dst.mesh.ranks}"
        for i, pieces in enumerate(self.phases):
            moved = sum(p.numel for p in pieces if not p.local)
            copied = sum(p.numel for p in pieces if p.local)
            lines.append(
                f"  phase {i}: {len(pieces)} pieces, {moved} elements sent, {copied} copied"
            )
        return "\n".join(lines)


def _receive_key(p: Piece) -> tuple[int, Box]:
    return p.src_rank, p.box


def _send_key(p: Piece) -> tuple[int, Box]:
    return p.dst_rank, p.box


# Index arithmetic -----------------------------------------------------------------------------


def local_index_runs(region: Region, box: Box) -> tuple[tuple[int, int], ...]:
    """Where ``box``'s elements sit in the local data of a rank holding ``region``.

    The local data is taken as 1-D: the row-major flattening of the local shard (of the
    region's box, or the flat range of it after a RaggedShard). Returns ``(start, length)``
    runs that, read in order, give the box's elements in the box's row-major order.

    Postconditions: runs are non-empty, ascending and non-adjacent (adjacent ones are
    merged); their lengths sum to the box's numel; every index lies in
    ``[0, region.numel)``. An empty box gives no runs.

    Raises:
        RedistributionError: when ``box`` has another number of dims than the region or is
            not inside it.
    """
    outer = region.box
    if len(box) != len(outer):
        raise RedistributionError(
            f"box {box} has {len(box)} dims; the region {outer} has {len(outer)}"
        )
    if box_numel(box) == 0:
        return ()
    for d, ((a, b), (lo, hi)) in enumerate(zip(box, outer, strict=True)):
        if not lo <= a <= b <= hi:
            raise RedistributionError(
                f"box {box} is not inside the region's box {outer}: dim {d} interval "
                f"{(a, b)} leaves {(lo, hi)}"
            )
    extents = [hi - lo for lo, hi in outer]
    strides = [math.prod(extents[d + 1 :]) for d in range(len(extents))]
    base = region.flat[0] if region.flat is not None else 0
    row = box[-1][1] - box[-1][0] if box else 1
    runs: list[list[int]] = []
    heads = itertools.product(*(range(a, b) for a, b in box[:-1]))
    last = (box[-1][0],) if box else ()
    for head in heads:
        start = sum(
            (i - lo) * s for i, (lo, _), s in zip((*head, *last), outer, strides, strict=True)
        )
        start -= base
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1][1] += row
        else:
            runs.append([start, row])
    held = region.numel
    if runs[0][0] < 0 or runs[-1][0] + runs[-1][1] > held:
        raise RedistributionError(
            f"box {box} is not inside the region {region}: it reaches local indices "
            f"[{runs[0][0]}, {runs[-1][0] + runs[-1][1]}) of the {held} held"
        )
    return tuple((s, n) for s, n in runs)


# Planning -------------------------------------------------------------------------------------


def _check_pair(src: Layout, dst: Layout, topology: Topology | None) -> None:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise RedistributionError(
            f"a transfer needs two hp_layout.Layout, got {type(src).__name__} and "
            f"{type(dst).__name__}"
        )
    if src.global_shape != dst.global_shape:
        raise RedistributionError(
            f"cannot transfer between global shapes {src.global_shape} and {dst.global_shape}; "
            "a transfer keeps the global shape"
        )
    for side, layout in (("source", src), ("destination", dst)):
        if layout.has_partial:
            raise RedistributionError(
                f"the {side} layout {layout!r} has Partial axes {list(layout.partial_axes)}; "
                "a transfer moves values and a reduction is not a transfer: reduce first "
                "(plan_redistribute to Replicate or Shard on the source mesh)"
            )
    if topology is not None:
        _check_topology(topology, set(src.mesh.ranks) | set(dst.mesh.ranks))


def _check_topology(topology: Topology, ranks: Iterable[int]) -> None:
    outside = sorted(r for r in ranks if r >= topology.world_size)
    if outside:
        raise RedistributionError(
            f"ranks {outside} lie outside topology {topology.name!r} of {topology.world_size} "
            "ranks; give a topology that spans both meshes"
        )


def _overlapping_pair(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes among ``boxes`` (non-empty ones), or None when all are disjoint."""
    if boxes and not boxes[0]:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    # Sweep along dim 0: only boxes whose dim-0 intervals overlap can overlap.
    ordered = sorted(boxes)
    active: list[Box] = []
    for box in ordered:
        active = [b for b in active if b[0][1] > box[0][0]]
        for b in active:
            if box_numel(box_intersection(b, box)):
                return b, box
        active.append(box)
    return None


@lru_cache(maxsize=4096)
def _distinct_regions(src: Layout) -> tuple[tuple[Region, tuple[int, ...]], ...]:
    """The non-empty regions of ``src`` with the ranks holding each (ascending), sorted.

    Raises:
        RedistributionError: when the regions are not disjoint or do not cover the tensor.
    """
    holders: dict[Region, list[int]] = {}
    for r in src.mesh.ranks:
        region = src.local_region(r)
        if region.numel:
            holders.setdefault(region, []).append(r)
    boxes = [b for region in holders for b in region.boxes()]
    clash = _overlapping_pair(boxes)
    if clash is not None:
        raise RedistributionError(
            f"the source layout {src!r} gives overlapping regions (boxes {clash[0]} and "
            f"{clash[1]}); a transfer needs every element held by exactly one set of replicas"
        )
    covered = sum(box_numel(b) for b in boxes)
    if covered != src.numel:
        raise RedistributionError(
            f"the source layout {src!r} holds {covered} distinct elements of the "
            f"{src.numel} of shape {src.global_shape}; a transfer needs the whole tensor held"
        )
    return tuple(
        sorted(
            ((region, tuple(sorted(ranks))) for region, ranks in holders.items()),
            key=lambda item: (item[0].box, item[0].flat or (0, 0)),
        )
    )


class _Chooser:
    """Picks senders: the fastest tier to the receiver, then the least loaded, then lowest."""

    def __init__(self, topology: Topology | None) -> None:
        self.topology = topology
        self.load: dict[int, int] = {}

    def level(self, a: int, b: int) -> int:
        if self.topology is None:
            return 0
        return self.topology.tier_level(self.topology.tier_of_group((a, b)))

    def choose(self, dst_rank: int, holders: Iterable[int], numel: int) -> int:
        sender = min(holders, key=lambda h: (self.level(h, dst_rank), self.load.get(h, 0), h))
        self.load[sender] = self.load.get(sender, 0) + numel
        return sender


def _intersections(target: Region, source: Region) -> list[Box]:
    out = []
    for a in target.boxes():
        for b in source.boxes():
            box = box_intersection(a, b)
            if box_numel(box):
                out.append(box)
    return out


def _overlaps(a: Box, b: Box) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _fill(
    dst_rank: int,
    target: Region,
    regions: tuple[tuple[Region, tuple[int, ...]], ...],
    chooser: _Chooser,
    local_ok: bool,
) -> list[Piece]:
    """Pieces that give ``dst_rank`` exactly ``target``, one sender per source region."""
    pieces: list[Piece] = []
    for region, holders in regions:
        if not _overlaps(region.box, target.box):
            continue
        boxes = _intersections(target, region)
        if not boxes:
            continue
        if local_ok and dst_rank in holders:
            sender = dst_rank
        else:
            sender = chooser.choose(dst_rank, holders, sum(box_numel(b) for b in boxes))
        pieces.extend(Piece(sender, dst_rank, b) for b in boxes)
    return pieces


def _sorted(pieces: list[Piece]) -> tuple[Piece, ...]:
    return tuple(sorted(pieces, key=lambda p: (p.dst_rank, p.src_rank, p.box)))


@lru_cache(maxsize=4096)
def _plan_direct(src: Layout, dst: Layout, topology: Topology | None) -> TransferPlan:
    regions = _distinct_regions(src)
    chooser = _Chooser(topology)
    pieces: list[Piece] = []
    for d in sorted(dst.mesh.ranks):
        pieces.extend(_fill(d, dst.local_region(d), regions, chooser, local_ok=True))
    return TransferPlan(src, dst, (_sorted(pieces),), DIRECT)


@lru_cache(maxsize=4096)
def _plan_full_gather(src: Layout, dst: Layout, topology: Topology | None) -> TransferPlan:
    regions = _distinct_regions(src)
    whole = _whole(src.global_shape)
    gather: list[Piece] = []
    chooser = _Chooser(topology)
    for s in sorted(src.mesh.ranks):
        gather.extend(_fill(s, whole, regions, chooser, local_ok=True))
    # Phase 1: after phase 0 every source rank holds everything, so all are candidates.
    everyone = ((whole, tuple(sorted(src.mesh.ranks))),) if src.numel else ()
    chooser = _Chooser(topology)
    scatter: list[Piece] = []
    for d in sorted(dst.mesh.ranks):
        scatter.extend(_fill(d, dst.local_region(d), everyone, chooser, local_ok=True))
    return TransferPlan(src, dst, (_sorted(gather), _sorted(scatter)), FULL_GATHER)


def plan_transfer(src: Layout, dst: Layout, topology: Topology | None = None) -> TransferPlan:
    """The direct transfer from ``src`` to ``dst`` (any two meshes, same global shape).

    One phase. Each destination rank receives exactly its region, every element once: a local
    copy of what it already holds as a source rank; every other part of a source region from
    one of that region's holders, the one reached over the fastest tier of ``topology``
    (without one, every pair of ranks counts as one tier), then the one with the fewest
    elements assigned so far, then the lowest rank. Results are cached.

    Postconditions: see :class:`TransferPlan`; moreover ``elements_moved()`` is at most that
    of :func:`plan_full_gather_transfer`, and so is each tier's count when every destination
    rank outside the source mesh reaches all source ranks over the same tier.

    Raises:
        RedistributionError: when the shapes differ, a layout has a Partial axis, a rank lies
            outside ``topology``, or the source regions do not tile the tensor.
    """
    _check_pair(src, dst, topology)
    return _plan_direct(src, dst, topology)


def plan_full_gather_transfer(
    src: Layout, dst: Layout, topology: Topology | None = None
) -> TransferPlan:
    """The baseline transfer: every source rank gathers the whole tensor, then hands it out.

    Phase 0: every source rank copies its own region and receives each other source region
    from one holder (chosen as in :func:`plan_transfer`). Phase 1: every destination rank
    that is a source rank copies its region out of its whole tensor; every other receives it
    from one source rank (fastest tier, least loaded, lowest). Results are cached.

    Raises:
        RedistributionError: as :func:`plan_transfer`.
    """
    _check_pair(src, dst, topology)
    return _plan_full_gather(src, dst, topology)
