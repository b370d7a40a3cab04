"""The weight sync's plan: every tensor's transfer from the training layout to the rollout
layout, and each rank's program of messages.

:func:`plan_sync` takes one :class:`Route` per tensor (its name, the layout training holds it
in, the layout the rollout engine holds it in, its item size) and plans each with hp-layout
(:func:`hp_layout.plan_transfer` for ``"direct"``: every rollout rank receives exactly its
shard, each element once, from the holder on the fastest link; or
:func:`hp_layout.plan_full_gather_transfer` for ``"full_gather"``: the training ranks first
gather whole tensors, then hand out the rollout shards, what a trainer does without a planner).
:meth:`SyncPlan.program` cuts the plan into one rank's program: per phase, the pieces it sends
to each peer and receives from each peer (all of one peer's pieces in one message, in an
order both ends derive alike: tensor index, then box) and the pieces it copies locally.

Postconditions (tested): the pieces in every rank's programs are the transfer plans' pieces,
each once as a send on its sender and once as a receive on its receiver (or once as a local
copy); a sender's list for a peer equals the peer's receive list from it, in the same order.

Pure data: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hp_layout import (
    Layout,
    Piece,
    Topology,
    TransferPlan,
    plan_full_gather_transfer,
    plan_transfer,
)

__all__ = ["METHODS", "Move", "PhaseProgram", "RankProgram", "Route", "SyncPlan", "plan_sync"]

SyncMethod = Literal["direct", "full_gather"]
#: The sync methods: hp-layout's direct transfer, and the gather-everything baseline.
METHODS: tuple[str, ...] = ("direct", "full_gather")


@dataclass(frozen=True)
class Route:
    """One tensor the sync moves.

    Attributes:
        name: its name (the model's parameter or buffer name).
        src: its layout in training (the ranks holding its shards).
        dst: its layout in the rollout engine.
        itemsize: bytes per element (the dtype both sides hold it in).
    """

    name: str
    src: Layout
    dst: Layout
    itemsize: int

    def __post_init__(self) -> None:
        if self.src.global_shape != self.dst.global_shape:
            raise ValueError(
                f"tensor {self.name!r}: training holds shape {self.src.global_shape}, the rollout "
                f"engine {self.dst.global_shape}; a weight sync needs the same global shape on both"
            )
        if self.itemsize <= 0:
            raise ValueError(
                f"tensor {self.name!r}: itemsize must be positive, got {self.itemsize}"
            )


@dataclass(frozen=True)
class Move:
    """One piece of one tensor: ``route`` indexes :attr:`SyncPlan.routes`."""

    route: int
    piece: Piece

    @property
    def key(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The order both ends of a message list its pieces in."""
        return (self.route, self.piece.box)


@dataclass(frozen=True)
class PhaseProgram:
    """What one rank does in one phase.

    Attributes:
        sends: ``(peer, moves)`` per peer this rank sends to, peers ascending.
        receives: ``(peer, moves)`` per peer this rank receives from, peers ascending.
        local: the pieces this rank copies from its own source shard.
    """

    sends: tuple[tuple[int, tuple[Move, ...]], ...]
    receives: tuple[tuple[int, tuple[Move, ...]], ...]
    local: tuple[Move, ...]


@dataclass(frozen=True)
class RankProgram:
    """One rank's part of a :class:`SyncPlan`, phase by phase."""

    rank: int
    phases: tuple[PhaseProgram, ...]


@dataclass(frozen=True)
class SyncPlan:
    """Every route's transfer plan, all of one method."""

    routes: tuple[Route, ...]
    transfers: tuple[TransferPlan, ...]
    method: str

    @property
    def n_phases(self) -> int:
        """Phases every rank runs in order (1 for direct, 2 for full_gather)."""
        return max((len(t.phases) for t in self.transfers), default=0)

    def program(self, rank: int) -> RankProgram:
        """``rank``'s messages and local copies, phase by phase (see the module docstring)."""
        phases = []
        for phase in range(self.n_phases):
            sends: dict[int, list[Move]] = {}
            receives: dict[int, list[Move]] = {}
            local: list[Move] = []
            for index, transfer in enumerate(self.transfers):
                if phase >= len(transfer.phases):
                    continue
                for piece in transfer.phases[phase]:
                    move = Move(index, piece)
                    if piece.src_rank == rank and piece.dst_rank == rank:
                        local.append(move)
                    elif piece.src_rank == rank:
                        sends.setdefault(piece.dst_rank, []).append(move)
                    elif piece.dst_rank == rank:
                        receives.setdefault(piece.src_rank, []).append(move)
            phases.append(
                PhaseProgram(
                    _by_peer(sends), _by_peer(receives), tuple(sorted(local, key=_move_key))
                )
            )
        return RankProgram(rank, tuple(phases))

    def elements_by_tier(self, topology: Topology) -> dict[str, int]:
        """Elements crossing each tier of ``topology``, summed over every route."""
        out: dict[str, int] = {tier.name: 0 for tier in topology.tiers}
        for transfer in self.transfers:
            for tier, count in transfer.elements_by_tier(topology).items():
                out[tier] = out.get(tier, 0) + count
        return out

    def bytes_by_tier(self, topology: Topology) -> dict[str, int]:
        """Bytes crossing each tier of ``topology`` (each route at its item size)."""
        out: dict[str, int] = {tier.name: 0 for tier in topology.tiers}
        for route, transfer in zip(self.routes, self.transfers, strict=True):
            for tier, count in transfer.elements_by_tier(topology).items():
                out[tier] = out.get(tier, 0) + count * route.itemsize
        return out

    def bytes_moved(self) -> int:
        """Bytes sent between ranks (local copies excluded), over every route."""
        return sum(
            t.elements_moved() * r.itemsize
            for r, t in zip(self.routes, self.transfers, strict=True)
        )


def _move_key(move: Move) -> tuple[int, tuple[tuple[int, int], ...]]:
    return move.key


def _by_peer(moves: Mapping[int, list[Move]]) -> tuple[tuple[int, tuple[Move, ...]], ...]:
    return tuple((peer, tuple(sorted(moves[peer], key=_move_key))) for peer in sorted(moves))


def plan_sync(
    routes: Sequence[Route], method: str = "direct", topology: Topology | None = None
) -> SyncPlan:
    """The transfer plan of every route by ``method`` (``"direct"`` or ``"full_gather"``).

    Raises:
        ValueError: an unknown method, or two routes of one name.
    """
    if method not in METHODS:
        raise ValueError(f"sync method must be one of {METHODS}, got {method!r}")
    names = [r.name for r in routes]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"each tensor is synced once; routes repeat {duplicated}")
    planner = plan_transfer if method == "direct" else plan_full_gather_transfer
    transfers = tuple(planner(r.src, r.dst, topology) for r in routes)
    return SyncPlan(tuple(routes), transfers, method)
