"""The parallel plan of a run: resolved without processes, applied, written as ``plan.json``.

``plan.json`` is the parallel plan the run applied (hp-dtensor's
:class:`~hp_dtensor.parallel.ParallelPlan`, as :meth:`~hp_dtensor.parallel.ParallelPlan.to_dict`
gives it), written once the model is laid out and the optimizer built, before the first step
(rewritten by every start, a resume too: a resumed run may have another layout). Each parameter
carries its optimizer group (``"muon"`` or ``"adamw"``, from the optimizer the run built).
With ``tp > 1`` it is ``hp_dtensor.contract.parallel_plan_of(model)`` after
:func:`~hp_train.parallel.parallelize.parallelize`, with FSDP's flat slots where hp-fsdp records
them;
with ``tp == 1`` no tensor-parallel plan is applied and it is the plan resolved on the run's
mesh with no entries (every parameter replicated over the mesh), with those flat slots. With
pipelining the file is ``{"pp": P, "stages": [plan of stage 0, ...]}``: the first rank of each
stage sends its stage's plan to rank 0, which writes the one file.

:func:`resolve_run_plans` resolves the same plans on a meta-device model without any process
(``python -m hp_train --print-plan`` prints them with :func:`plan_report`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor.contract import parallel_plan_of
from hp_dtensor.parallel import ParallelPlan
from hp_muon import ChainedOptimizer
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.dryrun.shapes import job_mesh, planned_model
from hp_train.model.llama import Transformer
from hp_train.observe.metrics import write_json
from hp_train.optim import build_optimizer
from hp_train.parallel.parallelize import Layout3D, check_model_fits
from hp_train.parallel.pipeline import keep_stage, stage_boundaries

__all__ = [
    "PLAN_FILE",
    "applied_plan",
    "optimizer_groups",
    "plan_report",
    "resolve_run_plans",
    "write_plan",
]

#: The applied parallel plan, beside ``metrics.jsonl`` (see the module docstring).
PLAN_FILE = "plan.json"


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


def resolve_run_plans(
    model_config: ModelConfig, parallel: ParallelConfig, config: TrainConfig
) -> list[ParallelPlan]:
    """The plan :func:`train` applies, one per pipeline stage (one without pipelining),
    resolved on a meta-device model without any process group, with each parameter's
    optimizer group from the optimizer the run builds (:func:`hp_train.optim.build_optimizer`
    on the meta model: Muon/AdamW by ``hp_muon.split_params``, or AdamW alone).

    Stage ``k``'s plan is over its ``(dp_replicate, dp_shard, tp)`` ranks of the
    ``(pp, dp_replicate, dp_shard, tp)`` grid and names the modules the stage keeps.

    Raises:
        ConfigError: the model cannot be split ``tp`` ways or into ``pp`` stages.
    """
    check_model_fits(model_config, parallel)
    check_combination(model_config, parallel, config)
    if parallel.cp > 1 or parallel.ep > 1:
        raise ConfigError(
            f"--print-plan resolves the tensor-parallel and FSDP plan; it does not model "
            f"{'--cp' if parallel.cp > 1 else '--ep'} yet (a run writes the plan it applied to "
            "<out>/plan.json)"
        )
    grid = job_mesh(parallel)
    plans: list[ParallelPlan] = []
    for k in range(parallel.pp):
        with torch.device("meta"):
            model = Transformer(model_config)
        if parallel.pp > 1:
            keep_stage(model, k, stage_boundaries(model_config, parallel.pp))
        groups = optimizer_groups(model, build_optimizer(model, config))
        # The stage's plan with the FSDP slots of its first rank, as hp-fsdp will plan them.
        first = grid.rank_at((k, 0, 0, 0)) if parallel.pp > 1 else 0
        plans.append(
            planned_model(model_config, parallel, rank=first).with_optimizer_groups(groups)
        )
    return plans


def plan_report(model_config: ModelConfig, parallel: ParallelConfig, config: TrainConfig) -> str:
    """What ``--print-plan`` prints: a header line naming the world size and the axes, then
    the plan table of :func:`resolve_run_plans` (local shapes of the first rank), one per
    pipeline stage with a line naming the stage's modules and ranks."""
    plans = resolve_run_plans(model_config, parallel, config)
    axes = f"dp_replicate={parallel.dp_replicate} x dp_shard={parallel.dp_shard} x tp={parallel.tp}"
    kind = "MoE" if model_config.moe else "dense"
    header = (
        f"hp-train plan: world size {parallel.world_size} = "
        + (f"pp={parallel.pp} x {axes}" if parallel.pp > 1 else axes)
        + f"; {kind} model dim {model_config.dim}, {model_config.n_layers} layers; "
        f"optimizer {config.optimizer}"
    )
    if parallel.pp == 1:
        return f"{header}\n\n{plans[0].table(rank=0)}"
    boundaries = stage_boundaries(model_config, parallel.pp)
    parts = [
        f"{header}; one plan per pipeline stage (each over its stage's "
        "dp_replicate x dp_shard x tp ranks, naming the modules the stage keeps)"
    ]
    for k, plan in enumerate(plans):
        first, end = boundaries[k], boundaries[k + 1]
        held = [f"blocks {first}..{end - 1}" if end - first > 1 else f"block {first}"]
        if k == 0:
            held.insert(0, "the embedding")
        if k == parallel.pp - 1:
            held.append("the final norm and the head")
        ranks = plan.mesh.ranks
        parts.append(
            f"=== stage {k} of {parallel.pp}: {', '.join(held)}; ranks {ranks[0]}..{ranks[-1]}"
            f"\n\n{plan.table(rank=ranks[0])}"
        )
    return "\n\n".join(parts)


def applied_plan(
    model: Transformer, unstyled: ParallelPlan | None, optimizer: torch.optim.Optimizer
) -> ParallelPlan:
    """The plan the run applied (see the module docstring); ``unstyled``: the plan resolved
    before :func:`parallelize` when ``tp == 1`` (no TP plan is applied then)."""
    applied = parallel_plan_of(model)
    if unstyled is None:
        if applied is None:
            raise RuntimeError("parallelize() applied a tensor-parallel plan but none is recorded")
        plan = applied
    else:
        slots = {p.fqn: p.flat for p in applied.params if p.flat} if applied else {}
        plan = unstyled.with_flat_slots(slots)
    return plan.with_optimizer_groups(optimizer_groups(model, optimizer))


def write_plan(path: Path, plan: ParallelPlan, layout: Layout3D, rank: int) -> None:
    """Rank 0 writes ``plan.json``; with pipelining the first rank of each stage sends its
    stage's plan to rank 0 first (collective)."""
    if layout.pipeline_mesh is None:
        if rank == 0:
            write_json(path, plan.to_dict())
        return
    mine = plan.to_dict() if plan.mesh.ranks[0] == rank else None
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        # pp is the outermost axis: the stages' first ranks come in stage order.
        stages = [entry for entry in gathered if entry is not None]
        write_json(path, {"pp": len(stages), "stages": stages})
