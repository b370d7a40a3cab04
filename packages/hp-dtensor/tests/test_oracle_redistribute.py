"""``plan_for`` (a Partial destination from sharded data, as sharding rules need it) checked by
running its plan in ``hp_layout``'s NumPy reference executor: the destination pieces must
reduce to the source value, for every sharded source and Partial destination on a 1-d mesh
and a (2, 2) mesh, uneven shapes included. No processes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hp_dtensor.redistribute import plan_for
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    RedistributionError,
    Replicate,
    Shard,
    plan_redistribute,
)
from hp_layout.reference import assemble, execute, scatter

SHAPE = (5, 3)


def _cases() -> list[tuple[Mesh, tuple[Placement, ...], tuple[Placement, ...]]]:
    cases = []
    for mesh in (Mesh((2,), ("tp",)), Mesh((2, 2), ("dp", "tp"))):
        options: list[Placement] = [Replicate(), Shard(0), Shard(1), Partial()]
        for src, dst in itertools.product(itertools.product(options, repeat=mesh.ndim), repeat=2):
            # Where plan_for matters: some axis goes from sharded data to Partial.
            if any(
                isinstance(q, Partial) and isinstance(p, Shard)
                for p, q in zip(src, dst, strict=True)
            ):
                cases.append((mesh, src, dst))
    return cases


@pytest.mark.parametrize(("mesh", "src", "dst"), _cases())
def test_plan_for_keeps_the_value_from_shards_to_partial(
    mesh: Mesh, src: tuple[Placement, ...], dst: tuple[Placement, ...]
) -> None:
    source, target = Layout(SHAPE, mesh, src), Layout(SHAPE, mesh, dst)
    with pytest.raises(RedistributionError):
        plan_redistribute(source, target)  # why plan_for exists
    rng = np.random.default_rng(0)
    value = rng.integers(-9, 10, SHAPE).astype(np.float64)
    plan = plan_for(source, target)
    assert (plan.src, plan.dst) == (source, target)
    result = execute(plan, scatter(value, source, rng))
    assert set(result.shards) == set(mesh.ranks)
    for rank, piece in result.shards.items():
        assert piece.shape == target.local_shape(rank)
    np.testing.assert_array_equal(assemble(result.shards, target), value)
