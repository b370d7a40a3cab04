"""The job's rank grids against the rank arithmetic written out by hand.

A rank's coordinates are ``(pp, dp_replicate, dp_shard, cp, tp)`` row-major, ``tp`` fastest:
``rank = (((p * R + r) * S + s) * C + c) * T + t``. From that formula alone: which ranks form a
stage, an FSDP group, a context group and an expert group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from hp_layout import Mesh
from hp_planner import JobDims, PlanInputError, StageMeshes, job_grid, stage_meshes, stage_of
from hp_planner.meshes import across_stages

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
    JobDims(pp=2, dp_shard=2, cp=2),
    JobDims(pp=2, dp_replicate=2, dp_shard=2, ep=2, tp=2),
    JobDims(dp_shard=2, cp=2, ep=2),
    JobDims(dp_replicate=2, cp=2, ep=2, tp=2),
    JobDims(pp=2, dp_shard=2, cp=2, ep=4),
    JobDims(dp_shard=4, cp=2, ep=4),
]


def _coordinates(d: JobDims) -> dict[int, tuple[int, int, int, int, int]]:
    out = {}
    for p, r, s, c, t in itertools.product(
        range(d.pp), range(d.dp_replicate), range(d.dp_shard), range(d.cp), range(d.tp)
    ):
        rank = (((p * d.dp_replicate + r) * d.dp_shard + s) * d.cp + c) * d.tp + t
        out[rank] = (p, r, s, c, t)
    return out


def _ep_peers(d: JobDims, rank: int) -> list[int]:
    """The ranks of ``rank``'s expert-parallel group, from the rank formula."""
    coords = _coordinates(d)

    def key(c: tuple[int, int, int, int, int]) -> tuple[int, int, int, int]:
        return c[0], c[1], (c[2] * d.cp + c[3]) // d.ep, c[4]

    return sorted(q for q, c in coords.items() if key(c) == key(coords[rank]))


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
                # ep is the innermost part of the shard axis s x cp (flattened s * C + c):
                # peers differ in (s * C + c) % ep only.
                assert _ep_peers(dims, rank) == sorted(meshes.expert.submesh(["ep"], rank).ranks)
            holders = sorted(sorted(m.ranks) for m in meshes.expert_fsdp_meshes())
            assert sorted(r for group in holders for r in group) == stage
            shards = dims.dp_shard * dims.cp // dims.ep
            assert all(len(g) == dims.dp_replicate * shards for g in holders)
    assert seen == set(range(dims.world_size))


def test_bad_dims_are_named() -> None:
    with pytest.raises(PlanInputError, match="ep=3 must divide dp_shard=4"):
        JobDims(dp_shard=4, ep=3)
    # Under context parallelism ep takes whole cp groups of the dp_shard x cp shard axis.
    with pytest.raises(PlanInputError, match="ep=2 with cp=4 must be a multiple of cp"):
        JobDims(dp_shard=2, cp=4, ep=2)
    with pytest.raises(PlanInputError, match="dividing dp_shard x cp = 4"):
        JobDims(dp_shard=2, cp=2, ep=8)
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


@pytest.mark.parametrize("dims", DIMS, ids=repr)
def test_across_stages_slices_to_each_ranks_stage_mesh(dims: JobDims) -> None:
    """Each kind of stage mesh stacked over ``pp``: a mesh over the whole world whose slice
    through a rank is that rank's stage's mesh, ranks in the same order; the pp groups of the
    stacked stage mesh hold ranks whose formula coordinates differ in ``p`` only."""
    coords = _coordinates(dims)
    kinds: dict[str, Callable[[StageMeshes], Mesh | None]] = {
        "stage": lambda m: m.stage,
        "context": lambda m: m.context,
        "expert": lambda m: m.expert,
    }
    for kind, part in kinds.items():
        whole = across_stages(dims, part)
        own = part(stage_meshes(dims, 0))
        if own is None:
            assert whole is None, kind
            continue
        assert whole is not None
        assert sorted(whole.ranks) == list(range(dims.world_size)), kind
        if dims.pp == 1:
            assert whole == own
            continue
        assert whole.axis_names == ("pp", *own.axis_names)
        for rank in range(dims.world_size):
            want = part(stage_meshes(dims, coords[rank][0]))
            assert whole.submesh(list(own.axis_names), rank) == want, (kind, rank)
            peers = whole.submesh(["pp"], rank).ranks
            assert [coords[q][0] for q in peers] == list(range(dims.pp))
            assert {coords[q][1:] for q in peers} == {coords[rank][1:]}


def test_across_stages_refuses_a_part_that_differs_between_stages() -> None:
    dims = JobDims(pp=2, dp_shard=2)
    with pytest.raises(ValueError, match="None on stage 0 but not on every stage"):
        across_stages(dims, lambda m: None if 0 in m.stage.ranks else m.stage)
    with pytest.raises(ValueError, match="does not have stage 0's shape"):
        across_stages(dims, lambda m: m.stage if 0 in m.stage.ranks else m.stage.flatten())


@pytest.mark.parametrize("dims", [d for d in DIMS if d.ep > 1], ids=repr)
def test_the_pricing_grids_expert_groups_are_the_runtimes(dims: JobDims) -> None:
    """hp-planner's pricing lays every axis out in one grid; its expert-parallel and expert
    FSDP groups hold the ranks the runtime's expert meshes hold (the rank formula)."""
    from hp_layout import Topology
    from hp_planner.price.comm import RankGrid

    grid = RankGrid.build(dims, Topology.single_host(dims.world_size))
    assert grid.size("ep") == dims.ep
    assert grid.size("dp_shard") == dims.dp_shard * dims.cp
    for rank in range(dims.world_size):
        assert sorted(grid.mesh.group_of(rank, list(grid.axes("ep")))) == _ep_peers(dims, rank)
        coordinate = grid.coordinate(rank)
        _, _, s, c, _ = _coordinates(dims)[rank]
        assert (coordinate["dp_shard"], coordinate["fsdp"]) == (s, s * dims.cp + c)
        assert coordinate["expert_shard"] == (s * dims.cp + c) // dims.ep
