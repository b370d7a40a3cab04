"""The rank grids of a job, as pure ``hp_layout.Mesh`` values.

Layout of the ranks (row-major, last axis fastest): ``(pp, dp_replicate, dp_shard, cp, tp)``,
the ``pp`` and ``cp`` axes present only when larger than 1. ``tp`` is innermost so that
tensor-parallel peers are neighbours (the fastest links); ``pp`` is outermost (one activation
per microbatch crosses a stage boundary, the least traffic).

Per pipeline stage:

* the **stage mesh** ``(dp_replicate, dp_shard, tp)``, with ``cp > 1``
  ``(dp_replicate, dp_shard_cp, tp)``: the ``cp`` ranks of a data-parallel rank hold the same
  parameters, so tensor parallelism and FSDP see ``dp_shard x cp`` as one axis;
* the **FSDP meshes**: the stage mesh's sub-meshes over ``dp_axes`` (HSDP's
  ``(dp_replicate, shard)`` when ``dp_replicate > 1``, else the shard axis alone), one per
  tensor-parallel coordinate;
* the **context mesh** (``cp > 1``): ``(dp_replicate, dp_shard, cp, tp)`` over the stage's
  ranks, whose ``cp`` axis the attention exchanges run on;
* the **expert mesh** (``ep > 1``): ``(dp_replicate, expert_shard, ep, tp)`` over the stage
  mesh's ranks in the same order (``ep`` carved from the shard axis, ``dp_shard`` or
  ``dp_shard_cp``, innermost of it: with ``cp > 1`` an expert group takes whole context
  groups), and its FSDP axes ``expert_dp_axes`` (the ranks holding the same experts).

Postconditions (tested): every stage mesh, context mesh and expert mesh of a stage holds the
same set of ranks; the stages partition the world; the FSDP meshes of a stage partition its
ranks.

Across stages (:func:`across_stages`): one kind of stage mesh of every stage stacked along a
leading ``pp`` axis, a mesh over the whole job. Process groups are created collectively over
the job, so a runtime that creates each stage's groups from that one mesh creates the same
groups in the same order on every rank, whichever stage it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hp_layout import Mesh
from hp_planner.inputs import JobDims

__all__ = ["StageMeshes", "across_stages", "job_grid", "stage_meshes", "stage_of"]

REPLICATE = "dp_replicate"
SHARD = "dp_shard"
CP_SHARD = "dp_shard_cp"
STAGE_AXES = (REPLICATE, SHARD, "tp")
EXPERT_AXES = (REPLICATE, "expert_shard", "ep", "tp")


@dataclass(frozen=True)
class StageMeshes:
    """One pipeline stage's meshes (module docstring).

    Attributes:
        stage: the mesh tensor parallelism and FSDP apply to.
        shard_axis: its FSDP shard axis (``dp_shard`` or ``dp_shard_cp``).
        dp_axes: the FSDP mesh's axes of ``stage`` (replicate first under HSDP).
        context: with ``cp > 1`` the ``(dp_replicate, dp_shard, cp, tp)`` mesh, else None.
        expert: with ``ep > 1`` the ``(dp_replicate, expert_shard, ep, tp)`` mesh, else None.
        expert_dp_axes: the expert mesh's FSDP axes (``()`` without ``ep``).
    """

    stage: Mesh
    shard_axis: str
    dp_axes: tuple[str, ...]
    context: Mesh | None = None
    expert: Mesh | None = None
    expert_dp_axes: tuple[str, ...] = ()

    def fsdp_meshes(self) -> tuple[Mesh, ...]:
        """The stage's FSDP meshes, one per tensor-parallel coordinate, in rank order."""
        return self.stage.submeshes(list(self.dp_axes))

    def expert_fsdp_meshes(self) -> tuple[Mesh, ...]:
        """The FSDP meshes of the experts (the ranks holding the same experts), in rank
        order; ``()`` without expert parallelism."""
        if self.expert is None:
            return ()
        return self.expert.submeshes(list(self.expert_dp_axes))


def job_grid(dims: JobDims) -> Mesh:
    """The job's rank grid over ranks ``0 .. world_size - 1`` (module docstring)."""
    shape: list[int] = []
    names: list[str] = []
    if dims.pp > 1:
        shape.append(dims.pp)
        names.append("pp")
    shape += [dims.dp_replicate, dims.dp_shard]
    names += [REPLICATE, SHARD]
    if dims.cp > 1:
        shape.append(dims.cp)
        names.append("cp")
    shape.append(dims.tp)
    names.append("tp")
    return Mesh(tuple(shape), tuple(names))


def stage_of(dims: JobDims, rank: int) -> int:
    """The pipeline stage ``rank`` belongs to (``pp`` is the grid's outermost axis).

    Raises:
        ValueError: ``rank`` is outside the job's ``world_size`` ranks.
    """
    grid = job_grid(dims)
    if rank not in grid:
        raise ValueError(f"rank {rank} is outside the world of {grid.size} ranks")
    return grid.coordinate(rank)[0] if dims.pp > 1 else 0


def stage_meshes(dims: JobDims, stage: int) -> StageMeshes:
    """Stage ``stage``'s meshes (module docstring).

    Raises:
        ValueError: ``stage`` is not in ``0 .. pp - 1``.
    """
    if not 0 <= stage < dims.pp:
        raise ValueError(f"stage must be in 0..{dims.pp - 1}, got {stage}")
    grid = job_grid(dims)
    if dims.pp > 1:
        first = grid.rank_at((stage,) + (0,) * (grid.ndim - 1))
        grid = grid.submesh([n for n in grid.axis_names if n != "pp"], first)
    context: Mesh | None = None
    shard_axis = SHARD
    mesh = grid
    if dims.cp > 1:
        context = grid
        mesh = grid.flatten([SHARD, "cp"], CP_SHARD)
        shard_axis = CP_SHARD
    dp_axes = (REPLICATE, shard_axis) if dims.dp_replicate > 1 else (shard_axis,)
    expert: Mesh | None = None
    expert_dp_axes: tuple[str, ...] = ()
    if dims.ep > 1:
        # Carved from the stage mesh's shard axis (dp_shard x cp under context parallelism).
        shape = (dims.dp_replicate, dims.dp_shard * dims.cp // dims.ep, dims.ep, dims.tp)
        expert = Mesh(shape, EXPERT_AXES, mesh.ranks)
        expert_dp_axes = (REPLICATE, "expert_shard") if dims.dp_replicate > 1 else ("expert_shard",)
    return StageMeshes(mesh, shard_axis, dp_axes, context, expert, expert_dp_axes)


def across_stages(dims: JobDims, part: Callable[[StageMeshes], Mesh | None]) -> Mesh | None:
    """``part`` of every stage's meshes (e.g. ``lambda m: m.expert``) as one mesh over the job.

    Postconditions: with ``pp == 1`` the result is ``part(stage_meshes(dims, 0))`` itself;
    with ``pp > 1`` its axes are ``("pp", *part's axes)`` and for every rank ``r`` its
    sub-mesh over the part's axes through ``r`` equals ``part`` of ``r``'s stage, ranks in the
    same order. None when ``part`` gives None (every stage has the same kinds of meshes).

    Raises:
        ValueError: the stages' parts differ in shape or axis names, or are None on some
            stages only (a ``part`` that does not pick one kind of stage mesh).
    """
    parts = [part(stage_meshes(dims, k)) for k in range(dims.pp)]
    first = parts[0]
    if first is None:
        if any(p is not None for p in parts):
            raise ValueError("the part is None on stage 0 but not on every stage")
        return None
    if dims.pp == 1:
        return first
    ranks: list[int] = []
    for k, mesh in enumerate(parts):
        if mesh is None or (mesh.shape, mesh.axis_names) != (first.shape, first.axis_names):
            raise ValueError(
                f"stage {k}'s part {mesh!r} does not have stage 0's shape and axes {first!r}"
            )
        ranks.extend(mesh.ranks)
    return Mesh((dims.pp, *first.shape), ("pp", *first.axis_names), ranks)
