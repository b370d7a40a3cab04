from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _strategies import layouts, meshes, shapes
from hp_layout import (
    Layout,
    Mesh,
    MeshError,
    Partial,
    PlacementError,
    RaggedShard,
    Replicate,
    Shard,
    is_sharding,
)


def _mask(layout: Layout, rank: int) -> np.ndarray:
    """Boolean mask of the global elements ``rank`` holds, from its region's boxes."""
    mask = np.zeros(layout.global_shape, dtype=bool)
    for box in layout.local_region(rank).boxes():
        mask[tuple(slice(a, b) for a, b in box)] = True
    return mask


@st.composite
def layout_cases(draw: st.DrawFn) -> Layout:
    mesh = draw(meshes())
    shape = draw(shapes())
    return draw(layouts(mesh, shape))


@given(layout_cases())
def test_shards_of_each_whole_tensor_group_tile_the_tensor_exactly(layout: Layout) -> None:
    for group in layout.mesh.groups(layout.sharded_axes):
        count = sum(_mask(layout, r).astype(int) for r in group)
        assert np.all(count == 1) if layout.numel else True


@given(layout_cases())
def test_local_shape_offset_and_numel_agree_with_the_region(layout: Layout) -> None:
    total = 0
    for rank in layout.mesh.ranks:
        region = layout.local_region(rank)
        assert layout.local_numel(rank) == int(_mask(layout, rank).sum())
        assert layout.local_numel(rank) == int(np.prod(layout.local_shape(rank)))
        assert layout.local_offset(rank) == tuple(a for a, _ in region.box)
        if layout.ragged_axis is None:
            assert layout.local_shape(rank) == tuple(b - a for a, b in region.box)
        else:
            assert len(layout.local_shape(rank)) == 1
        total += layout.local_numel(rank)
    assert layout.total_local_numel() == total


@given(layout_cases())
def test_groups_have_the_meaning_their_names_promise(layout: Layout) -> None:
    for rank in layout.mesh.ranks:
        region = layout.local_region(rank)
        for other in layout.replica_group(rank):
            assert layout.local_region(other) == region
        for other in layout.partial_group(rank):
            assert layout.local_region(other) == region
        whole = layout.owner_candidates(rank)
        assert rank in whole
        assert whole in layout.whole_tensor_groups()
        assert set(layout.shard_group(rank)) <= set(whole)
    assert sorted(r for g in layout.whole_tensor_groups() for r in g) == sorted(layout.mesh.ranks)


@given(layout_cases(), st.data())
def test_ranks_holding_matches_brute_force(layout: Layout, data: st.DataObject) -> None:
    box = []
    for n in layout.global_shape:
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, n))
        box.append((a, b))
    target = np.zeros(layout.global_shape, dtype=bool)
    target[tuple(slice(a, b) for a, b in box)] = True
    expected = tuple(r for r in layout.mesh.ranks if (_mask(layout, r) & target).any())
    assert layout.ranks_holding(box) == expected


@given(layout_cases())
def test_layouts_are_values(layout: Layout) -> None:
    again = Layout(layout.global_shape, layout.mesh, layout.placements, layout.shard_order)
    assert again == layout
    assert hash(again) == hash(layout)
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert {layout: 1}[again] == 1


def test_shard_order_matters_only_for_axes_on_the_same_dim() -> None:
    mesh = Mesh((2, 3), ("dp", "tp"))
    a = Layout((7, 5), mesh, [Shard(0), Shard(1)], ["tp", "dp"])
    b = Layout((7, 5), mesh, [Shard(0), Shard(1)])
    assert a == b
    outer_dp = Layout((7, 5), mesh, [Shard(0), Shard(0)], ["dp", "tp"])
    outer_tp = Layout((7, 5), mesh, [Shard(0), Shard(0)], ["tp", "dp"])
    assert outer_dp != outer_tp
    # dp first: dp splits 7 rows into 4+3, then tp splits each part in 3.
    assert [outer_dp.local_region(mesh.rank_at((1, t))).box[0] for t in range(3)] == [
        (4, 5),
        (5, 6),
        (6, 7),
    ]
    # tp first: tp splits 7 into 3+3+1, dp splits each in two.
    assert [outer_tp.local_region(mesh.rank_at((d, 2))).box[0] for d in range(2)] == [
        (6, 7),
        (7, 7),
    ]
    assert outer_tp.dim_sharding(0) == ("tp", "dp")
    assert "shard_order=['tp', 'dp']" in repr(outer_tp)


def test_is_sharding_names_the_placements_that_split() -> None:
    assert is_sharding(Shard(0))
    assert is_sharding(RaggedShard((1, 2)))
    assert not is_sharding(Replicate())
    assert not is_sharding(Partial("max"))


def test_negative_dims_normalize() -> None:
    mesh = Mesh((2,), ("tp",))
    assert Layout((4, 6), mesh, [Shard(-1)]) == Layout((4, 6), mesh, [Shard(1)])


def test_fsdp_over_tp_ragged_layout() -> None:
    mesh = Mesh((2, 2), ("dp", "tp"))
    # TP splits rows, then FSDP's flat buffer gives the two dp ranks 5 and 7 elements of the
    # 3 x 4 TP-local block.
    layout = Layout((6, 4), mesh, [RaggedShard((5, 7)), Shard(0)])
    assert layout.shard_order == ("tp", "dp")
    region = layout.local_region(mesh.rank_at((1, 1)))
    assert region.box == ((3, 6), (0, 4))
    assert region.flat == (5, 12)
    assert layout.local_shape(mesh.rank_at((0, 1))) == (5,)
    assert layout.ranks_holding([(0, 1), (0, 4)]) == (mesh.rank_at((0, 0)),)
    assert layout.ranks_holding([(1, 2), (0, 4)]) == (mesh.rank_at((0, 0)), mesh.rank_at((1, 0)))


def test_queries_on_768_ranks() -> None:
    mesh = Mesh((8, 12, 8), ("pp", "dp", "tp"))
    layout = Layout((4096, 1000), mesh, [Replicate(), Shard(0), Shard(1)])
    assert layout.local_shape(0) == (342, 125)
    assert layout.local_shape(767) == (4096 - 11 * 342, 125)
    assert layout.total_local_numel() == 8 * 4096 * 1000
    assert len(layout.whole_tensor_groups()) == 8
    assert layout.replica_group(0) == tuple(range(0, 768, 96))
    assert layout.ranks_holding([(0, 1), (0, 1)]) == tuple(range(0, 768, 96))


@pytest.mark.parametrize(
    ("shape", "placements", "order", "message"),
    [
        ((4, 4), [Shard(2), Replicate()], None, r"Shard\(2\) on mesh axis 'dp' is out of range"),
        ((), [Shard(0), Replicate()], None, "the tensor is 0-d"),
        ((4,), [Replicate()], None, "has 2 axes but 1 placements"),
        ((4,), [Replicate(), "x"], None, "is not a placement"),
        ((4,), [Partial("sum"), Partial("max")], None, "mix Partial reductions"),
        ((4,), [RaggedShard((2, 2)), RaggedShard((1, 1))], None, "at most one mesh axis"),
        ((4,), [RaggedShard((1, 2)), Replicate()], None, "covers 3 elements but the block"),
        ((4,), [RaggedShard((1, 2, 1)), Replicate()], None, "has 3 entries; the axis has size 2"),
        ((5,), [RaggedShard((1, 1)), Shard(0)], None, "different numbers of elements"),
        ((4,), [RaggedShard((2, 2)), Shard(0)], ["dp", "tp"], "must be the last sharding"),
        ((4,), [Shard(0), Shard(0)], ["dp"], r"must list every sharding axis; missing \['tp'\]"),
        ((4,), [Shard(0), Shard(0)], ["dp", "dp", "tp"], "names an axis twice"),
        ((-1,), [Replicate(), Replicate()], None, "non-negative int sizes"),
    ],
)
def test_bad_layouts_name_the_value_and_the_rule(
    shape: tuple[int, ...], placements: list[object], order: list[str] | None, message: str
) -> None:
    mesh = Mesh((2, 2), ("dp", "tp"))
    with pytest.raises(PlacementError, match=message):
        Layout(shape, mesh, placements, order)  # type: ignore[arg-type]


def test_unknown_axis_in_shard_order_is_named() -> None:
    with pytest.raises(MeshError, match="unknown mesh axis 'pp'"):
        Layout((4,), Mesh((2,), ("dp",)), [Shard(0)], ["pp"])


def test_bad_placement_arguments() -> None:
    with pytest.raises(PlacementError, match="is not a known reduction"):
        Partial("prod")
    with pytest.raises(PlacementError, match="needs an int dimension"):
        Shard(1.5)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="non-negative ints"):
        RaggedShard((1, -1))
    with pytest.raises(PlacementError, match="outside"):
        Layout((4,), Mesh((2,), ("dp",)), [Shard(0)]).ranks_holding([(0, 5)])
