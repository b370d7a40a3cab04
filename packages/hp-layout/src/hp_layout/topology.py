"""Topology: the tiers of links between ranks, fast to slow, with an alpha-beta cost model.

A tier groups consecutive global ranks into blocks of ``size`` ranks (one host, one
supernode, the whole cluster); the blocks of a tier nest inside the blocks of the next. A
group of ranks communicates over the fastest tier whose block contains all of them. Each
tier has a per-rank bandwidth (bytes/s, one direction) and a per-message latency (s), from
which :meth:`Topology.collective_time` estimates a ring collective's time as
``steps * latency + bytes_per_rank / bandwidth``.

The presets carry nominal figures. They order the tiers correctly and are good for planning;
replace them with measured values when absolute times matter.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from hp_layout.errors import TopologyError
from hp_layout.mesh import Mesh

__all__ = ["Collective", "Tier", "Topology"]


class Collective(enum.Enum):
    """The collectives the cost model knows. ``nbytes`` conventions are in ``collective_time``."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


@dataclass(frozen=True)
class Tier:
    """One level of links.

    Attributes:
        name: a label such as ``"host"`` or ``"supernode"``.
        size: ranks per block of this tier (consecutive global ranks).
        bandwidth: bytes per second one rank can send (and receive) over this tier.
        latency: seconds per message over this tier.
    """

    name: str
    size: int
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.name:
            raise TopologyError("a tier needs a non-empty name")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise TopologyError(f"tier {self.name!r} needs a positive int size, got {self.size!r}")
        if not self.bandwidth > 0:
            raise TopologyError(f"tier {self.name!r} needs bandwidth > 0, got {self.bandwidth}")
        if not self.latency >= 0:
            raise TopologyError(f"tier {self.name!r} needs latency >= 0, got {self.latency}")


@dataclass(frozen=True)
class Topology:
    """Tiers from fast to slow; the last tier spans the whole world.

    Attributes:
        tiers: fast to slow; sizes strictly increase and each divides the next; bandwidth
            does not increase and latency does not decrease from one tier to the next.
        name: a label for reports.
    """

    tiers: tuple[Tier, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.tiers:
            raise TopologyError("a topology needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise TopologyError(f"tier names must be unique, got {names}")
        for fast, slow in zip(self.tiers, self.tiers[1:], strict=False):
            if slow.size <= fast.size or slow.size % fast.size:
                raise TopologyError(
                    f"tier {slow.name!r} (size {slow.size}) must be a multiple larger than tier "
                    f"{fast.name!r} (size {fast.size}); tiers go fast to slow and nest"
                )
            if slow.bandwidth > fast.bandwidth or slow.latency < fast.latency:
                raise TopologyError(
                    f"tier {slow.name!r} is faster than tier {fast.name!r} before it; "
                    "list tiers from fast to slow"
                )

    @property
    def world_size(self) -> int:
        """Number of ranks the topology spans."""
        return self.tiers[-1].size

    def tier(self, name: str) -> Tier:
        """The tier called ``name``."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise TopologyError(f"no tier {name!r}; tiers are {[t.name for t in self.tiers]}")

    def tier_level(self, tier: Tier) -> int:
        """Index of ``tier``, 0 for the fastest."""
        return self.tiers.index(tier)

    def tier_of_group(self, ranks: Iterable[int]) -> Tier:
        """The fastest tier whose block holds every rank of the group."""
        group = tuple(ranks)
        for r in group:
            if not 0 <= r < self.world_size:
                raise TopologyError(
                    f"rank {r} is outside topology {self.name!r} of {self.world_size} ranks"
                )
        for t in self.tiers:
            if len({r // t.size for r in group}) <= 1:
                return t
        raise AssertionError("unreachable: the last tier spans every rank")

    def axis_tier(self, mesh: Mesh, axis: str | int) -> Tier:
        """The slowest tier that any group along ``axis`` of ``mesh`` needs."""
        return _axis_tier(self, mesh, mesh.axis_index(axis))

    def axis_tiers(self, mesh: Mesh) -> dict[str, Tier]:
        """Map each axis name of ``mesh`` to the tier its groups communicate over."""
        return {name: self.axis_tier(mesh, name) for name in mesh.axis_names}

    def collective_time(
        self, kind: Collective, group_size: int, nbytes: float, tier: Tier
    ) -> float:
        """Alpha-beta time of one ring collective over a group of ``group_size`` ranks.

        ``nbytes`` is the size of the whole buffer each rank ends up with or starts from:
        the all-gather output, the reduce-scatter input, the all-reduce buffer, the bytes
        one rank holds before an all-to-all, the broadcast buffer, the message of a send.
        The time is non-decreasing in ``nbytes`` and in ``group_size``.
        """
        if nbytes < 0:
            raise TopologyError(f"nbytes must be non-negative, got {nbytes}")
        if group_size < 1:
            raise TopologyError(f"group_size must be positive, got {group_size}")
        p = group_size
        if kind is Collective.SEND_RECV:
            return tier.latency + nbytes / tier.bandwidth
        if p == 1:
            return 0.0
        share = (p - 1) / p * nbytes / tier.bandwidth
        if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
            return (p - 1) * tier.latency + share
        if kind is Collective.ALL_REDUCE:
            return 2 * ((p - 1) * tier.latency + share)
        if kind is Collective.BROADCAST:
            return math.ceil(math.log2(p)) * tier.latency + nbytes / tier.bandwidth
        raise AssertionError(f"unhandled collective {kind}")

    # Presets ---------------------------------------------------------------------------------

    @classmethod
    def single_host(
        cls, ranks: int = 8, bandwidth: float = 100e9, latency: float = 5e-6
    ) -> Topology:
        """One host of ``ranks`` ranks behind one fast link tier."""
        return cls((Tier("host", ranks, bandwidth, latency),), name=f"single_host[{ranks}]")

    @classmethod
    def two_tier_cluster(
        cls,
        hosts: int,
        ranks_per_host: int,
        intra_bandwidth: float = 100e9,
        intra_latency: float = 5e-6,
        inter_bandwidth: float = 12.5e9,
        inter_latency: float = 20e-6,
    ) -> Topology:
        """``hosts`` hosts of ``ranks_per_host`` ranks; fast inside a host, slower across.

        Nominal figures: 100 GB/s and 5 us inside a host, 12.5 GB/s (a 100 Gb/s NIC per
        rank) and 20 us across hosts.
        """
        if hosts == 1:
            return cls.single_host(ranks_per_host, intra_bandwidth, intra_latency)
        return cls(
            (
                Tier("host", ranks_per_host, intra_bandwidth, intra_latency),
                Tier("cluster", hosts * ranks_per_host, inter_bandwidth, inter_latency),
            ),
            name=f"cluster[{hosts}x{ranks_per_host}]",
        )

    @classmethod
    def ascend_supernode(cls, supernodes: int = 1) -> Topology:
        """Ascend SuperPoD: 384 NPU cards of two dies each (768 ranks) per supernode.

        Ranks are dies. Nominal per-die figures after Huawei's published CloudMatrix384
        description: the two dies of one card share an on-package link (~540 GB/s); the
        Unified Bus joins all 384 cards of a supernode (~392 GB/s per card one way, shared by
        its two dies, ~196 GB/s each); supernodes connect over RDMA (~400 Gb/s per card,
        ~25 GB/s per die). Latencies: ~0.5 us on package, ~2 us over the Unified Bus, ~10 us
        over RDMA.
        """
        if supernodes < 1:
            raise TopologyError(f"supernodes must be positive, got {supernodes}")
        tiers = [Tier("card", 2, 540e9, 0.5e-6), Tier("supernode", 768, 196e9, 2e-6)]
        if supernodes > 1:
            tiers.append(Tier("cluster", 768 * supernodes, 25e9, 10e-6))
        return cls(tuple(tiers), name=f"ascend_supernode[{supernodes}x768]")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Topology:
        """The default topology of a ``torchrun`` job: hosts of ``LOCAL_WORLD_SIZE`` ranks.

        Reads ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (both default to 1).
        """
        env = os.environ if environ is None else environ
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError as exc:
            raise TopologyError(f"WORLD_SIZE / LOCAL_WORLD_SIZE must be integers: {exc}") from None
        if world < 1 or local < 1 or world % local:
            raise TopologyError(
                f"WORLD_SIZE={world} must be a positive multiple of LOCAL_WORLD_SIZE={local}"
            )
        return cls.two_tier_cluster(world // local, local)


@lru_cache(maxsize=1024)
def _axis_tier(topology: Topology, mesh: Mesh, axis: int) -> Tier:
    slowest = topology.tiers[0]
    for group in mesh.groups(axis):
        tier = topology.tier_of_group(group)
        if topology.tier_level(tier) > topology.tier_level(slowest):
            slowest = tier
    return slowest
