"""The text form of a :class:`~hp_planner.JobPlan`: one table per pipeline stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # job.py imports this module: the types only, for annotations
    from hp_planner.job import JobPlan, StagePlan

__all__ = ["job_table", "stage_table"]


def _axes(plan: JobPlan) -> str:
    return " x ".join(
        f"{n}={s}" for n, s in zip(plan.grid.axis_names, plan.grid.shape, strict=True)
    )


def stage_table(stage: StagePlan) -> str:
    """One stage's body: the parallel plan's table (local shapes of the stage's first rank),
    the ``fully_shard`` calls holding that rank, expert and context parallelism, the
    activation and offload policy."""
    first = stage.ranks[0]
    lines = [
        stage.parallel.table(rank=first),
        "",
        f"fully_shard calls holding rank {first} (hp-fsdp's plans; every FSDP mesh's are in "
        "plan.json):",
    ]
    lines.extend(
        f"  {group.unit or '<root>'}: {len(plan.fqns)} params, buffer "
        f"{plan.flat.padded_numel} x {plan.storage_dtype} in chunks of {plan.chunk_numel} "
        f"over ranks {list(group.mesh.ranks)}"
        + (f", tail all-reduced over {plan.extra_reduce}" if plan.extra_reduce else "")
        for group in stage.fsdp
        if first in group.mesh
        for plan in group.plans
    )
    lines.extend(
        f"expert parallel: {expert.module} over {expert.plan.mesh.axis_names} "
        f"{list(expert.plan.mesh.shape)}"
        for expert in stage.experts
    )
    if stage.context is not None:
        lines.append(
            f"context parallel ({stage.context.variant}): {len(stage.context.modules)} "
            f"attention cores over cp={stage.context.mesh.axis_size('cp')}"
        )
    policy, modules = stage.activation
    if policy != "none":
        lines.append(f"activations: {policy} on {len(modules)} modules")
    if stage.offload != "none":
        lines.append(f"offload: {stage.offload}")
    return "\n".join(lines)


def _stage_header(stage: StagePlan, stages: int) -> str:
    ranks = stage.ranks
    mesh = stage.meshes.stage
    axes = " x ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape, strict=True))
    return (
        f"=== stage {stage.index} of {stages}: ranks {ranks[0]}..{ranks[-1]}; mesh {axes}; "
        f"FSDP over {', '.join(stage.meshes.dp_axes)}"
    )


def job_table(plan: JobPlan) -> str:
    """:meth:`JobPlan.table`."""
    head = f"job plan: world size {plan.dims.world_size} = {_axes(plan)}"
    parts = [head]
    if plan.schedule is not None:
        parts.append(
            f"pipeline schedule {plan.schedule.name}: {plan.schedule.num_stages} stages, "
            f"{plan.schedule.num_microbatches} microbatches"
        )
    parts.extend(
        f"{_stage_header(stage, len(plan.stages))}\n\n{stage_table(stage)}" for stage in plan.stages
    )
    return "\n\n".join(parts)
