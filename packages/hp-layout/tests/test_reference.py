from __future__ import annotations

import numpy as np
import pytest

from hp_layout import Layout, LayoutError, Mesh, Partial, Placement, Replicate, Shard
from hp_layout.reference import assemble, scatter

MESH = Mesh((2, 2), ("dp", "tp"))


def test_scatter_then_assemble_round_trips_with_random_partials() -> None:
    array = np.arange(30).reshape(5, 6)
    cases: tuple[list[Placement], ...] = (
        [Shard(0), Shard(1)],
        [Partial(), Shard(0)],
        [Partial("max"), Partial("max")],
    )
    for placements in cases:
        layout = Layout((5, 6), MESH, placements)
        shards = scatter(array, layout, rng=np.random.default_rng(0))
        np.testing.assert_array_equal(assemble(shards, layout), array)


def test_assemble_rejects_disagreeing_replicas_and_bad_shapes() -> None:
    layout = Layout((4, 6), MESH, [Replicate(), Shard(0)])
    shards = scatter(np.zeros((4, 6)), layout)
    shards[2] = shards[2] + 1
    with pytest.raises(LayoutError, match="disagrees"):
        assemble(shards, layout)
    shards = scatter(np.zeros((4, 6)), layout)
    shards[0] = np.zeros((3, 6))
    with pytest.raises(LayoutError, match=r"rank 0 holds shape \(3, 6\), layout wants \(2, 6\)"):
        assemble(shards, layout)
    del shards[0]
    with pytest.raises(LayoutError, match=r"no shard given for ranks \[0\]"):
        assemble(shards, layout)


def test_scatter_gives_replicas_identical_partial_pieces() -> None:
    layout = Layout((3, 4), MESH, [Replicate(), Partial()])
    shards = scatter(np.arange(12).reshape(3, 4), layout, rng=np.random.default_rng(5))
    for rank in MESH.ranks:
        for replica in layout.replica_group(rank):
            np.testing.assert_array_equal(shards[rank], shards[replica])
    assert not np.array_equal(shards[0], shards[1])
