from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hp_layout import Collective, Mesh, Tier, Topology, TopologyError


def test_tier_of_group_is_the_fastest_block_holding_all() -> None:
    topo = Topology.two_tier_cluster(hosts=4, ranks_per_host=8)
    assert topo.world_size == 32
    assert topo.tier_of_group([0, 7]).name == "host"
    assert topo.tier_of_group([7, 8]).name == "cluster"
    assert topo.tier_of_group([5]).name == "host"


def test_axis_tiers_follow_the_rank_grid() -> None:
    topo = Topology.two_tier_cluster(hosts=2, ranks_per_host=4)
    mesh = Mesh((2, 4), ("replicate", "shard"))
    assert {n: t.name for n, t in topo.axis_tiers(mesh).items()} == {
        "replicate": "cluster",
        "shard": "host",
    }
    # The same axes over a transposed rank grid swap tiers.
    transposed = Mesh.from_grid([[0, 2, 4, 6], [1, 3, 5, 7]], ["replicate", "shard"])
    assert topo.axis_tier(transposed, "replicate").name == "host"
    assert topo.axis_tier(transposed, "shard").name == "cluster"


def test_presets() -> None:
    supernode = Topology.ascend_supernode()
    assert supernode.world_size == 768
    assert [t.name for t in supernode.tiers] == ["card", "supernode"]
    two = Topology.ascend_supernode(supernodes=2)
    assert two.world_size == 1536
    assert two.tiers[-1].name == "cluster"
    assert Topology.single_host(4).world_size == 4
    assert Topology.two_tier_cluster(1, 8) == Topology.single_host(8)


def test_from_env_uses_torchrun_variables() -> None:
    topo = Topology.from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert [(t.name, t.size) for t in topo.tiers] == [("host", 8), ("cluster", 16)]
    assert Topology.from_env({}).world_size == 1
    with pytest.raises(TopologyError, match="positive multiple"):
        Topology.from_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(TopologyError, match="must be integers"):
        Topology.from_env({"WORLD_SIZE": "x"})


@given(
    st.sampled_from(list(Collective)),
    st.integers(1, 768),
    st.floats(0, 1e10),
    st.floats(0, 1e10),
)
def test_collective_time_is_monotone_in_bytes(
    kind: Collective, group: int, a: float, b: float
) -> None:
    topo = Topology.ascend_supernode()
    tier = topo.tiers[1]
    small, large = sorted((a, b))
    assert topo.collective_time(kind, group, small, tier) <= topo.collective_time(
        kind, group, large, tier
    )
    assert topo.collective_time(kind, group, small, tier) <= topo.collective_time(
        kind, group + 1, small, tier
    )


def test_collective_time_values() -> None:
    tier = Tier("t", 4, bandwidth=1e9, latency=1e-6)
    topo = Topology((tier,))
    # Ring all-gather: (p-1) latencies plus (p-1)/p of the output over the link.
    assert topo.collective_time(Collective.ALL_GATHER, 4, 4e9, tier) == pytest.approx(3e-6 + 3.0)
    assert topo.collective_time(Collective.ALL_REDUCE, 4, 4e9, tier) == pytest.approx(6e-6 + 6.0)
    assert topo.collective_time(Collective.ALL_GATHER, 1, 4e9, tier) == 0.0
    assert topo.collective_time(Collective.SEND_RECV, 2, 1e9, tier) == pytest.approx(1 + 1e-6)
    # Reduce-scatter and all-to-all move (p-1)/p of their input, like an all-gather.
    for kind in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        assert topo.collective_time(kind, 3, 3e9, tier) == pytest.approx(2e-6 + 2.0)
    # Broadcast (binomial tree): ceil(log2 p) latencies and the whole buffer once. A slow
    # link (1 ms per message) so that one latency more or less shows.
    slow = Tier("s", 8, bandwidth=1e9, latency=1e-3)
    for p, hops in ((2, 1), (3, 2), (4, 2), (5, 3), (8, 3)):
        got = Topology((slow,)).collective_time(Collective.BROADCAST, p, 1e6, slow)
        assert got == pytest.approx(hops * 1e-3 + 1e-3, rel=1e-12), p


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ((), "at least one tier"),
        ((Tier("a", 8, 1e9, 1e-6), Tier("b", 12, 1e8, 1e-5)), "multiple larger"),
        ((Tier("a", 8, 1e9, 1e-6), Tier("b", 16, 1e10, 1e-5)), "from fast to slow"),
        ((Tier("a", 8, 1e9, 1e-6), Tier("a", 16, 1e8, 1e-5)), "unique"),
    ],
)
def test_bad_topologies_are_rejected(tiers: tuple[Tier, ...], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology(tiers)


def test_bad_tiers_and_ranks_are_named() -> None:
    with pytest.raises(TopologyError, match="bandwidth > 0"):
        Tier("x", 2, 0.0, 1e-6)
    with pytest.raises(TopologyError, match="positive int size"):
        Tier("x", 0, 1.0, 1e-6)
    with pytest.raises(TopologyError, match="rank 9 is outside"):
        Topology.single_host(8).tier_of_group([1, 9])
    with pytest.raises(TopologyError, match="no tier 'rack'"):
        Topology.single_host(8).tier("rack")
