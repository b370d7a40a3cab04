"""The run's :class:`~hp_planner.JobPlan`: printed, checked against what ran, written.

The trainer plans its job once, before anything is built (:func:`hp_train.parallel.job.plan_run`,
pure), and executes that plan. Once the model is laid out and the optimizer built,
:func:`check_applied` compares what the executors did on this rank with the plan: the meshes,
every parameter's tensor-parallel layout and gradient reduction, its FSDP slot on this rank's
FSDP mesh (hp-fsdp's record) and its optimizer group; a difference stops the run naming it.
Then rank 0 writes the plan as ``plan.json`` (:meth:`~hp_planner.JobPlan.to_dict`; rewritten by
every start, a resume too).

``python -m hp_train --print-plan`` prints the same plan (:func:`plan_report`) without any
process: a header naming the world, the axes, the model and the optimizer, then one table per
pipeline stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hp_dtensor.contract import parallel_plan_of
from hp_layout import Mesh
from hp_mpmd import SchedulePlan
from hp_muon import ChainedOptimizer
from hp_planner import JobPlan, StagePlan
from hp_planner.report import stage_table
from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
from hp_train.observe.metrics import write_json
from hp_train.parallel.job import plan_run
from hp_train.parallel.parallelize import Layout3D
from hp_train.parallel.pipeline import stage_boundaries

__all__ = [
    "PLAN_FILE",
    "PlanMismatchError",
    "check_applied",
    "optimizer_groups",
    "plan_report",
    "write_plan",
]

#: The run's plan, beside ``metrics.jsonl`` (see the module docstring).
PLAN_FILE = "plan.json"


class PlanMismatchError(RuntimeError):
    """An executor did something else than the run's plan says (the message names it)."""


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Each trainable parameter's optimizer, by name (``"muon"``, ``"adamw"``: the lower-cased
    class name of the optimizer holding it; a :class:`hp_muon.ChainedOptimizer` is looked
    into)."""
    parts = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else (optimizer,)
    owner = {
        id(p): type(part).__name__.lower()
        for part in parts
        for group in part.param_groups
        for p in group["params"]
    }
    return {name: owner[id(p)] for name, p in model.named_parameters() if id(p) in owner}


def _first_difference(what: str, applied: dict[str, Any], planned: dict[str, Any]) -> None:
    for name in sorted(set(applied) | set(planned)):
        got, want = applied.get(name), planned.get(name)
        if got != want:
            raise PlanMismatchError(
                f"{what} of {name!r}: the run applied {got!r}, the job plan says {want!r}"
            )


def _check_meshes(stage: StagePlan, layout: Layout3D, rank: int) -> None:
    planned = stage.meshes
    context = planned.context.submesh(["cp"], rank) if planned.context is not None else None
    built: list[tuple[str, Mesh | None, Mesh | None]] = [
        ("stage", layout.mesh.mesh, planned.stage),
        ("FSDP", layout.dp_mesh.mesh, planned.stage.submesh(list(planned.dp_axes), rank)),
        ("context", None if layout.cp_mesh is None else layout.cp_mesh.mesh, context),
        ("expert", None if layout.expert_mesh is None else layout.expert_mesh.mesh, planned.expert),
    ]
    for name, mesh, want in built:
        if mesh != want:
            raise PlanMismatchError(f"{name} mesh: the run built {mesh}, the job plan says {want}")


def check_applied(
    job: JobPlan, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout3D, rank: int
) -> None:
    """Raise :class:`PlanMismatchError` naming the first thing this rank's executors did otherwise
    than ``job`` says (module docstring): ``layout`` holds the meshes the run built."""
    stage = job.stage_of(rank)
    _check_meshes(stage, layout, rank)
    applied = parallel_plan_of(model)
    if applied is None:
        raise PlanMismatchError("no parallel plan is recorded on the model (FSDP recorded no slot)")
    _first_difference(
        "FSDP slot",
        {p.fqn: p.flat for p in applied.params if p.flat is not None},
        stage.flat_slots(rank),
    )
    if job.dims.tp > 1:
        _first_difference(
            "tensor-parallel layout",
            {p.fqn: (p.layout, p.reduction) for p in applied.params},
            {p.fqn: (p.layout, p.reduction) for p in stage.parallel.params},
        )
    _first_difference(
        "optimizer group",
        optimizer_groups(model, optimizer),
        {p.fqn: p.optimizer_group for p in stage.parallel.params if p.optimizer_group},
    )


def _held(model: ModelConfig, schedule: SchedulePlan, k: int) -> str:
    """What pipeline rank ``k`` keeps: its stages' blocks (``schedule.stages_of(k)``), the
    embedding with stage 0 and the final norm and head with the last stage."""
    boundaries = stage_boundaries(model, schedule.num_stages)
    stages = schedule.stages_of(k)
    held = []
    for s in stages:
        first, end = boundaries[s], boundaries[s + 1]
        blocks = f"blocks {first}..{end - 1}" if end - first > 1 else f"block {first}"
        held.append(blocks if len(stages) == 1 else f"stage {s} ({blocks})")
    if 0 in stages:
        held.insert(0, "the embedding")
    if schedule.num_stages - 1 in stages:
        held.append("the final norm and the head")
    return ", ".join(held)


def plan_report(model_config: ModelConfig, parallel: ParallelConfig, config: TrainConfig) -> str:
    """What ``--print-plan`` prints: a header line naming the world size, the axes, the model
    and the optimizer, then each stage's table (:func:`hp_planner.report.stage_table`, local
    shapes of the stage's first rank), with pipelining under a line naming the stage's
    modules and ranks.

    Raises:
        ConfigError: see :func:`hp_train.parallel.job.plan_run`.
    """
    job = plan_run(model_config, parallel, config)
    axes = " x ".join(f"{n}={s}" for n, s in zip(job.grid.axis_names, job.grid.shape, strict=True))
    extra = "".join(f" x {n}={v}" for n, v in (("ep", parallel.ep),) if v > 1)
    kind = "MoE" if model_config.moe else "dense"
    header = (
        f"hp-train plan: world size {parallel.world_size} = {axes}{extra}; {kind} model dim "
        f"{model_config.dim}, {model_config.n_layers} layers; optimizer {config.optimizer}"
    )
    if job.schedule is None:
        return f"{header}\n\n{stage_table(job.stages[0])}"
    parts = [
        f"{header}; pipeline schedule {job.schedule.name} with {job.schedule.num_microbatches} "
        "microbatches; one plan per pipeline stage (each over its stage's dp_replicate x "
        "dp_shard x tp ranks, naming the modules the stage keeps)"
    ]
    for stage in job.stages:
        ranks = stage.ranks
        parts.append(
            f"=== stage {stage.index} of {parallel.pp}: "
            f"{_held(model_config, job.schedule, stage.index)}; ranks {ranks[0]}..{ranks[-1]}"
            f"\n\n{stage_table(stage)}"
        )
    return "\n\n".join(parts)


def write_plan(path: Path, job: JobPlan, rank: int) -> None:
    """Rank 0 writes ``job`` as ``plan.json`` (every rank holds the whole plan)."""
    if rank == 0:
        write_json(path, job.to_dict())
