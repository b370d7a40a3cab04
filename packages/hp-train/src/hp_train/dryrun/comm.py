"""Collectives of a step as data: who talks over which tier, how many bytes, how long.

Ranks are arranged as an :class:`hp_layout.Mesh` of axes ``(pp, dp_replicate, dp_shard, tp)``
in row-major order: tensor parallelism on neighbouring ranks (the fastest tier), pipeline
stages outermost. Each axis communicates over the slowest tier any of its groups spans
(:meth:`hp_layout.Topology.axis_tier`), and a collective's time is the topology's alpha-beta
ring estimate (:meth:`hp_layout.Topology.collective_time`).

Byte conventions, per call and per rank:

* ``nbytes``: the collective's buffer on its unsharded side, as ``hp_fsdp.counting`` records
  it (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor, a send's
  message; for Muon's all-to-alls, the larger of the send and receive buffers);
* ``sent_bytes``: what this rank puts on the wire: ``(p - 1) / p * nbytes`` for an
  all-gather or a reduce-scatter, ``2 (p - 1) / p * nbytes`` for a ring all-reduce, the message
  for a send, the bytes actually sent for an all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_layout import Collective, Mesh, Tier, Topology
from hp_train.config import ParallelConfig
from hp_train.dryrun.presets import DryRunError

__all__ = [
    "AXES",
    "KINDS",
    "CollectiveRecord",
    "RankGrid",
    "ring_sent_bytes",
]

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Mesh axes, outermost first."""

KINDS = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "hsdp_all_reduce",
    "tp",
    "pp",
    "muon",
)
"""Collective kinds a step is broken down by."""


def ring_sent_bytes(kind: Collective, group_size: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective over ``group_size`` ranks (see module doc)."""
    p = group_size
    if kind is Collective.SEND_RECV:
        return nbytes
    if p == 1:
        return 0.0
    if kind is Collective.ALL_REDUCE:
        return 2 * (p - 1) / p * nbytes
    return (p - 1) / p * nbytes


@dataclass(frozen=True)
class RankGrid:
    """The parallel configuration laid onto a topology.

    Attributes:
        parallel: the degrees.
        topology: the tiers; spans exactly ``parallel.world_size`` ranks.
        mesh: axes :data:`AXES` over ranks ``0 .. world - 1``.
    """

    parallel: ParallelConfig
    topology: Topology
    mesh: Mesh

    @staticmethod
    def build(parallel: ParallelConfig, topology: Topology) -> RankGrid:
        """The grid of ``parallel`` on ``topology``.

        Raises:
            DryRunError: the topology does not span the configuration's world size.
        """
        world = parallel.world_size
        if topology.world_size != world:
            raise DryRunError(
                f"topology {topology.name!r} has {topology.world_size} ranks but dp_replicate x "
                f"dp_shard x tp x pp = {parallel.dp_replicate} x {parallel.dp_shard} x "
                f"{parallel.tp} x {parallel.pp} = {world}; the degrees must multiply to the "
                "topology's world size"
            )
        p = parallel
        mesh = Mesh((p.pp, p.dp_replicate, p.dp_shard, p.tp), AXES)
        return RankGrid(parallel, topology, mesh)

    def size(self, axis: str) -> int:
        """Ranks along ``axis``."""
        return self.mesh.axis_size(axis)

    def tier(self, axis: str) -> Tier:
        """The tier groups along ``axis`` communicate over."""
        return self.topology.axis_tier(self.mesh, axis)

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate along each axis.

        Raises:
            DryRunError: ``rank`` is outside the world.
        """
        if not 0 <= rank < self.mesh.size:
            raise DryRunError(f"rank {rank} is outside the world of {self.mesh.size} ranks")
        return dict(zip(AXES, self.mesh.coordinate(rank), strict=True))

    def record(
        self,
        kind: str,
        collective: Collective,
        phase: str,
        axis: str,
        nbytes: float,
        calls: int = 1,
    ) -> CollectiveRecord | None:
        """A collective over ``axis`` (None when the axis has one rank or nothing moves)."""
        p = self.size(axis)
        if (p == 1 and collective is not Collective.SEND_RECV) or nbytes <= 0 or calls <= 0:
            return None
        tier = self.tier(axis)
        group = 2 if collective is Collective.SEND_RECV else p
        return CollectiveRecord(
            kind=kind,
            collective=collective,
            phase=phase,
            axis=axis,
            group_size=group,
            tier=tier.name,
            nbytes=int(nbytes),
            sent_bytes=int(ring_sent_bytes(collective, group, nbytes)),
            calls=calls,
            time=self.topology.collective_time(collective, group, nbytes, tier),
        )


@dataclass(frozen=True)
class CollectiveRecord:
    """``calls`` identical collectives of one step on one rank.

    Attributes:
        kind: one of :data:`KINDS`.
        collective: the collective.
        phase: ``"forward"``, ``"backward"``, ``"recompute"`` or ``"step"`` (optimizer).
        axis: the mesh axis of its group (``"world"`` for Muon's exchanges).
        group_size: ranks in its group.
        tier: the tier it runs over.
        nbytes: bytes per call, unsharded side (module doc).
        sent_bytes: bytes this rank sends per call.
        calls: how many per step.
        time: seconds per call (alpha-beta).
    """

    kind: str
    collective: Collective
    phase: str
    axis: str
    group_size: int
    tier: str
    nbytes: int
    sent_bytes: int
    calls: int
    time: float

    @property
    def total_nbytes(self) -> int:
        """``nbytes`` over all calls of the step."""
        return self.nbytes * self.calls

    @property
    def total_sent(self) -> int:
        """``sent_bytes`` over all calls of the step."""
        return self.sent_bytes * self.calls

    @property
    def total_time(self) -> float:
        """Seconds over all calls of the step."""
        return self.time * self.calls
