"""Collectives of a step as data: who talks over which tier, how many bytes, how long.

Ranks are arranged as an :class:`hp_layout.Mesh` of axes :data:`AXES` in row-major order:
tensor parallelism on neighbouring ranks (the fastest tier), pipeline stages outermost. Each
group (:data:`GROUPS`) communicates over the slowest tier any of its instances spans
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

from dataclasses import dataclass, field
from functools import lru_cache

from hp_layout import Collective, Mesh, Tier, Topology
from hp_planner.inputs import JobDims
from hp_planner.price.model import PricingError

__all__ = [
    "AXES",
    "KINDS",
    "CollectiveRecord",
    "RankGrid",
    "ring_sent_bytes",
]

AXES = ("pp", "dp_replicate", "expert_shard", "ep", "cp", "tp")
"""Mesh axes, outermost first: the runtime's grids (``hp_train.parallel.parallelize.build_layout``)
in one: ``dp_shard = expert_shard x ep`` (expert parallelism carved from the shard axis, ep
inner), ``cp`` between the shard axis and ``tp``. With ``ep`` and ``cp`` together the ``ep`` axis
holds ``ep / cp`` (an expert-parallel group is that axis times ``cp``: :meth:`RankGrid.axes`)."""

GROUPS: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("expert_shard", "ep", "cp"),
    "dp": ("dp_replicate", "expert_shard", "ep", "cp"),
    "expert_dp": ("dp_replicate", "expert_shard"),
    "expert_shard": ("expert_shard",),
    "ep": ("ep",),
    "cp": ("cp",),
    "tp": ("tp",),
}
"""The communication groups by name, as mesh axes: ``dp_shard`` is FSDP's shard group of the
dense parameters (``dp_shard x cp`` flattened under context parallelism, the runtime's
``dp_shard_cp``), ``expert_shard`` that of the experts (the ranks holding the same ones);
``dp`` and ``expert_dp`` every data-parallel rank of each (a DDP all-reduce's groups)."""

KINDS = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "hsdp_all_reduce",
    "ddp_all_reduce",
    "tp",
    "ep",
    "cp",
    "pp",
    "muon",
)
"""Collective kinds a step is broken down by: ``ddp_all_reduce`` is Megatron DDP's gradient
all-reduce (a modeled baseline, never hp-train's), ``ep`` is expert parallelism's (token dispatch
and combine, the count all-gather, FSDP's all-reduce of the router's and shared experts'
gradients over ep), ``cp`` context parallelism's (ring passes or Ulysses all-to-alls)."""


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

    parallel: JobDims
    topology: Topology
    mesh: Mesh
    _tiers: dict[str, Tier] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(parallel: JobDims, topology: Topology) -> RankGrid:
        """The grid of ``parallel`` on ``topology``.

        Raises:
            PricingError: the topology does not span the configuration's world size.
        """
        world = parallel.world_size
        if topology.world_size != world:
            p = parallel
            raise PricingError(
                f"topology {topology.name!r} has {topology.world_size} ranks but dp_replicate x "
                f"dp_shard x cp x tp x pp = {p.dp_replicate} x {p.dp_shard} x {p.cp} x {p.tp} x "
                f"{p.pp} = {world}; the degrees must multiply to the topology's world size"
            )
        p = parallel
        if p.ep > 1 and p.cp > 1:
            # ep carved from dp_shard x cp, innermost: whole cp groups times ep / cp shards.
            shards = p.dp_shard * p.cp // p.ep
            shape = (p.pp, p.dp_replicate, shards, p.ep // p.cp, p.cp, p.tp)
        else:
            shape = (p.pp, p.dp_replicate, p.dp_shard // p.ep, p.ep, p.cp, p.tp)
        return RankGrid(parallel, topology, Mesh(shape, AXES))

    def axes(self, group: str) -> tuple[str, ...]:
        """The mesh axes of the group named ``group`` (:data:`GROUPS`; under expert and
        context parallelism together an expert-parallel group spans the ``cp`` axis too)."""
        if group == "ep" and self.parallel.ep > 1 and self.parallel.cp > 1:
            return ("ep", "cp")
        return GROUPS[group]

    def size(self, axis: str) -> int:
        """Ranks of a group named ``axis`` (:meth:`axes`)."""
        n = 1
        for a in self.axes(axis):
            n *= self.mesh.axis_size(a)
        return n

    def tier(self, axis: str) -> Tier:
        """The tier groups named ``axis`` communicate over (the slowest any of them needs)."""
        tier = self._tiers.get(axis)
        if tier is None:
            tier = self._tiers[axis] = _group_tier(self.topology, self.mesh, self.axes(axis))
        return tier

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate along each mesh axis, plus ``dp_shard`` (its index among the
        data-parallel shards, ``expert_shard x ep``) and ``fsdp`` (its chunk of the dense
        groups, ``dp_shard x cp``).

        Raises:
            PricingError: ``rank`` is outside the world.
        """
        if not 0 <= rank < self.mesh.size:
            raise PricingError(f"rank {rank} is outside the world of {self.mesh.size} ranks")
        c = dict(zip(AXES, self.mesh.coordinate(rank), strict=True))
        c["dp_shard"] = c["expert_shard"] * self.mesh.axis_size("ep") + c["ep"]
        c["fsdp"] = c["dp_shard"] * self.mesh.axis_size("cp") + c["cp"]
        return c

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


@lru_cache(maxsize=4096)
def _group_tier(topology: Topology, mesh: Mesh, axes: tuple[str, ...]) -> Tier:
    """The slowest tier any group along ``axes`` of the row-major ``mesh`` (ranks
    ``0 .. size - 1``) needs: a group lies in one block of a tier exactly when its lowest and
    highest ranks do (blocks are intervals), what :meth:`hp_layout.Topology.axis_tier`
    finds by listing the groups, without listing them."""
    strides = [1] * mesh.ndim
    for i in range(mesh.ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * mesh.shape[i + 1]
    inside = {mesh.axis_index(a) for a in axes}
    span = sum((mesh.shape[i] - 1) * strides[i] for i in inside)
    bases = [0]
    for i in range(mesh.ndim):
        if i not in inside and mesh.shape[i] > 1:
            bases = [b + c * strides[i] for b in bases for c in range(mesh.shape[i])]
    for tier in topology.tiers:
        if all(b // tier.size == (b + span) // tier.size for b in bases):
            return tier
    return topology.tiers[-1]


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
