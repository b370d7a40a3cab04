"""The job's rank grids against the rank arithmetic written out by hand.

A rank's coordinates are ``(pp, dp_replicate, dp_shard, cp, tp)`` row-major, ``tp`` fastest:
``rank = (((p * R + r) * S + s) * C + c) * T + t``. From that formula alone: which ranks form a
stage, an FSDP group, a context group and an expert group.
"""

from __future__ import annotations

import itertools

import pytest

from hp_planner import JobDims, PlanInputError, job_grid, stage_meshes, stage_of

DIMS = [
    JobDims(dp_shard=4),
    JobDims(dp_replicate=2, dp_shard=2),
    JobDims(dp_shard=2, tp=2),
    JobDims(pp=2, dp_shard=2, tp=2),
    JobDims(pp=4, dp_replicate=2),
    JobDims(dp_shard=2, cp=2, tp=2),
    JobDims(dp_replicate=2, dp_shard=2, cp=2),
    JobDims(dp_shard=4, ep=2, tp=2),
    JobDims(dp_replicate=2, dp_shard=4, ep=4),
    JobDims(pp=2, dp_shard=4, ep=2),
]


def _coordinates(d: JobDims) -> dict[int, tuple[int, int, int, int, int]]:
    out = {}
    for p, r, s, c, t in itertools.product(
        range(d.pp), range(d.dp_replicate), range(d.dp_shard), range(d.cp), range(d.tp)
    ):
        rank = (((p * d.dp_replicate + r) * d.dp_shard + s) * d.cp + c) * d.tp + t
        out[rank] = (p, r, s, c, t)
    return out


@pytest.mark.parametrize("dims", DIMS, ids=repr)
def test_stage_fsdp_context_and_expert_groups_follow_the_rank_formula(dims: JobDims) -> None:
    coords = _coordinates(dims)
    assert sorted(job_grid(dims).ranks) == list(range(dims.world_size))
    seen: set[int] = set()
    for k in range(dims.pp):
        meshes = stage_meshes(dims, k)
        stage = sorted(meshes.stage.ranks)
        assert stage == sorted(r for r, c in coords.items() if c[0] == k)
        assert not seen & set(stage)
        seen |= set(stage)
        # FSDP groups: same stage and tp coordinate (HSDP: every replica and shard).
        fsdp = sorted(sorted(m.ranks) for m in meshes.fsdp_meshes())
        want = sorted(sorted(r for r in stage if coords[r][4] == t) for t in range(dims.tp))
        assert fsdp == want
        if dims.cp > 1:
            assert meshes.context is not None
            for rank in stage:
                group = sorted(meshes.context.submesh(["cp"], rank).ranks)
                p, r, s, _, t = coords[rank]
                assert group == sorted(
                    q for q, c in coords.items() if c[:3] == (p, r, s) and c[4] == t
                )
        else:
            assert meshes.context is None
        if dims.ep > 1:
            assert meshes.expert is not None
            assert sorted(meshes.expert.ranks) == stage
            for rank in stage:
                # ep is the innermost part of dp_shard: peers differ in s % ep only.
                p, r, s, _, t = coords[rank]
                peers = sorted(meshes.expert.submesh(["ep"], rank).ranks)
                assert peers == sorted(
                    q
                    for q, c in coords.items()
                    if (c[0], c[1], c[2] // dims.ep, c[4]) == (p, r, s // dims.ep, t)
                )
            holders = sorted(sorted(m.ranks) for m in meshes.expert_fsdp_meshes())
            assert sorted(r for group in holders for r in group) == stage
            assert all(len(g) == dims.dp_replicate * dims.dp_shard // dims.ep for g in holders)
    assert seen == set(range(dims.world_size))


def test_bad_dims_are_named() -> None:
    with pytest.raises(PlanInputError, match="ep=3 must divide dp_shard=4"):
        JobDims(dp_shard=4, ep=3)
    with pytest.raises(PlanInputError, match="tp must be a positive integer"):
        JobDims(tp=0)
    with pytest.raises(PlanInputError, match="cp_variant must be one of"):
        JobDims(cp=2, cp_variant="spiral")
    with pytest.raises(ValueError, match=r"stage must be in 0\.\.1"):
        stage_meshes(JobDims(pp=2), 2)


@pytest.mark.parametrize("dims", DIMS, ids=repr)
def test_a_ranks_stage_is_its_block_of_world_over_pp(dims: JobDims) -> None:
    """``stage_of``: ``pp`` is outermost, so stage ``s`` holds ranks ``s * world / pp`` up to
    the next stage's first; a rank outside the world is named."""
    per_stage = dims.world_size // dims.pp
    for rank in range(dims.world_size):
        assert stage_of(dims, rank) == rank // per_stage
        assert rank in stage_meshes(dims, stage_of(dims, rank)).stage
    with pytest.raises(ValueError, match=f"rank {dims.world_size} is outside the world"):
        stage_of(dims, dims.world_size)
