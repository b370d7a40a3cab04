"""Hypothesis strategies for meshes, shapes and layouts (shared by the hp_layout tests)."""

from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    PlacementError,
    RaggedShard,
    ReduceOp,
    Replicate,
    Shard,
)

AXIS_NAMES = ("a", "b", "c", "d")


@st.composite
def meshes(draw: st.DrawFn, max_axes: int = 4, max_size: int = 4, max_ranks: int = 24) -> Mesh:
    """Meshes of 1..max_axes axes with uneven sizes and a permuted, possibly sparse rank grid."""
    ndim = draw(st.integers(1, max_axes))
    shape: list[int] = []
    for _ in range(ndim):
        room = max_ranks // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(max_size, room)))))
    count = math.prod(shape)
    pool = draw(st.sampled_from([count, count + 3, 2 * count]))
    ranks = draw(st.permutations(range(pool)))[:count]
    return Mesh(shape, AXIS_NAMES[:ndim], ranks)


def shapes(max_dims: int = 4, max_size: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes of 0..max_dims dims, zero sizes included."""
    return st.lists(st.integers(0, max_size), min_size=0, max_size=max_dims).map(tuple)


def _split(draw: st.DrawFn, total: int, parts: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


@st.composite
def layouts(
    draw: st.DrawFn,
    mesh: Mesh,
    shape: tuple[int, ...],
    allow_partial: bool = True,
    allow_ragged: bool = True,
    op: ReduceOp | None = None,
) -> Layout:
    """A random layout of ``shape`` on ``mesh``: shards nested in a random order, at most one
    RaggedShard, Partial axes sharing one op."""
    partial_op = op if op is not None else draw(st.sampled_from(list(ReduceOp)))
    kinds = ["R", "S"] + (["P"] if allow_partial else [])
    placements: list[Placement] = []
    for _ in mesh.axis_names:
        kind = draw(st.sampled_from(kinds))
        if kind == "S" and shape:
            placements.append(Shard(draw(st.integers(-len(shape), len(shape) - 1))))
        elif kind == "P":
            placements.append(Partial(partial_op))
        else:
            placements.append(Replicate())
    order = list(draw(st.permutations(mesh.axis_names)))
    base = Layout(shape, mesh, placements, order)
    replicated = [i for i, p in enumerate(placements) if isinstance(p, Replicate)]
    if not (allow_ragged and replicated and draw(st.booleans())):
        return base
    axis = draw(st.sampled_from(replicated))
    block = {base.local_region(r).numel for r in mesh.ranks}
    if len(block) != 1:
        return base
    placements[axis] = RaggedShard(_split(draw, block.pop(), mesh.shape[axis]))
    try:
        return Layout(shape, mesh, placements, order)
    except PlacementError:
        return base
