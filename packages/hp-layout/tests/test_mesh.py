from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _strategies import meshes
from hp_layout import Mesh, MeshError


@given(meshes())
def test_coordinate_and_rank_at_are_inverse(mesh: Mesh) -> None:
    for rank in mesh.ranks:
        assert mesh.rank_at(mesh.coordinate(rank)) == rank
    coords = {mesh.coordinate(r) for r in mesh.ranks}
    assert len(coords) == mesh.size


@given(meshes(), st.data())
def test_groups_partition_the_mesh_and_vary_only_their_axes(
    mesh: Mesh, data: st.DataObject
) -> None:
    axes = data.draw(st.lists(st.sampled_from(mesh.axis_names), unique=True))
    groups = mesh.groups(axes)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == sorted(mesh.ranks)
    fixed = [i for i, n in enumerate(mesh.axis_names) if n not in axes]
    for group in groups:
        assert len(group) == (mesh.size // len(groups))
        keys = {tuple(mesh.coordinate(r)[i] for i in fixed) for r in group}
        assert len(keys) == 1
        for rank in group:
            assert mesh.group_of(rank, axes) == group


@given(meshes(), st.data())
def test_submesh_holds_the_rank_group_with_the_same_order(mesh: Mesh, data: st.DataObject) -> None:
    axes = data.draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, min_size=1))
    rank = data.draw(st.sampled_from(mesh.ranks))
    sub = mesh.submesh(axes, rank)
    assert sub.axis_names == tuple(axes)
    assert sub.ranks == mesh.group_of(rank, axes)
    assert rank in sub
    assert sub in mesh.submeshes(axes)
    for r in sub.ranks:
        inner = sub.coordinate(r)
        outer = mesh.coordinate(r)
        assert inner == tuple(outer[mesh.axis_index(a)] for a in axes)


@given(meshes(), st.data())
def test_flatten_keeps_the_groups_of_the_merged_axes(mesh: Mesh, data: st.DataObject) -> None:
    axes = data.draw(st.lists(st.sampled_from(mesh.axis_names), unique=True, min_size=1))
    flat = mesh.flatten(axes, "merged")
    assert flat.size == mesh.size
    assert sorted(flat.ranks) == sorted(mesh.ranks)
    assert flat.groups("merged") == mesh.groups(axes)
    others = [n for n in mesh.axis_names if n not in axes]
    assert [n for n in flat.axis_names if n != "merged"] == others
    if others:
        assert set(flat.groups(others)) == set(mesh.groups(others))


@given(meshes())
def test_equality_and_hash_cover_the_rank_grid(mesh: Mesh) -> None:
    same = Mesh(mesh.shape, mesh.axis_names, mesh.ranks)
    assert same == mesh
    assert hash(same) == hash(mesh)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    if mesh.size > 1:
        swapped = list(mesh.ranks)
        swapped[0], swapped[1] = swapped[1], swapped[0]
        assert Mesh(mesh.shape, mesh.axis_names, swapped) != mesh


def test_from_grid_reads_nested_lists() -> None:
    mesh = Mesh.from_grid([[0, 2], [1, 3]], ["dp", "tp"])
    assert mesh.shape == (2, 2)
    assert mesh.groups("tp") == ((0, 2), (1, 3))
    assert mesh.groups("dp") == ((0, 1), (2, 3))
    assert mesh.coordinate(1) == (1, 0)
    assert repr(mesh) == "Mesh(dp=2, tp=2, ranks=[0, 2, 1, 3])"


def test_flatten_default_merges_everything() -> None:
    mesh = Mesh((2, 3), ("dp", "tp"))
    flat = mesh.flatten()
    assert flat.axis_names == ("dp_tp",)
    assert flat.ranks == tuple(range(6))
    swapped = mesh.flatten(["tp", "dp"], "x")
    assert swapped.ranks == (0, 3, 1, 4, 2, 5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((2, 2), ("a",)), "has 2 axes but 1 names"),
        (((2, 0), ("a", "b")), "positive ints"),
        (((2,), ("a",), (0, 0)), "duplicates"),
        (((2,), ("a",), (0, 1, 2)), "needs 2 ranks, got 3"),
        (((2, 2), ("a", "a")), "unique"),
        (((2,), ("",)), "non-empty"),
        (((2,), ("a",), (0, -1)), "non-negative"),
    ],
)
def test_bad_meshes_are_rejected_with_the_rule(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(MeshError, match=message):
        Mesh(*args)  # type: ignore[arg-type]


def test_unknown_axes_and_ranks_are_named() -> None:
    mesh = Mesh((2, 2), ("dp", "tp"))
    with pytest.raises(
        MeshError, match=r"unknown mesh axis 'pp'; this mesh has axes \['dp', 'tp'\]"
    ):
        mesh.groups("pp")
    with pytest.raises(MeshError, match="rank 9 is not in"):
        mesh.coordinate(9)
    with pytest.raises(MeshError, match="outside mesh shape"):
        mesh.rank_at((2, 0))
    with pytest.raises(MeshError, match="pass rank="):
        mesh.submesh("tp")
    with pytest.raises(MeshError, match="name an axis twice"):
        mesh.groups(["dp", "dp"])
    with pytest.raises(MeshError, match="not rectangular"):
        Mesh.from_grid([[0, 1], [2]], ["a", "b"])
    with pytest.raises(AttributeError, match="immutable"):
        mesh.shape = (4,)
