"""The trainer's job as hp-planner's inputs, and its :class:`~hp_planner.JobPlan`.

:func:`plan_run` is the one place the trainer's configs become a plan: the Transformer built
on ``meta`` (one per pipeline stage, :func:`~hp_train.parallel.virtual.keep_stages`), the
degrees of :class:`~hp_train.config.schema.ParallelConfig`, the model's parallelism (Megatron's
tensor-parallel plan :func:`~hp_train.parallel.parallelize.tp_plan`, FSDP on every block then
the root, the MoE feed-forwards under expert parallelism, the attention cores under context
parallelism) and the recipe's optimizer split, precision, activation policy, offload and
pipeline schedule. ``--print-plan`` prints it, the run executes it (each executor checks its
part) and writes it as ``plan.json``.
"""

from __future__ import annotations

import torch

from hp_dtensor.parallel import ExpertParallel, ExpertTensorParallel, ParallelStyle
from hp_mpmd import SchedulePlan
from hp_planner import JobDims, JobPlan, ModelParallelism, TrainingPolicy, plan_job, plan_schedule
from hp_planner.meshes import EXPERT_AXES
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
from hp_train.model.llama import Transformer
from hp_train.optim import ROUTER_PATTERNS
from hp_train.parallel.parallelize import check_model_fits, tp_plan
from hp_train.parallel.pipeline import stage_boundaries
from hp_train.parallel.virtual import check_virtual_stages_fit, keep_stages

__all__ = ["BLOCKS", "CONTEXT_MODULES", "model_parallelism", "plan_run", "training_policy"]

#: The FSDP units: every block (the root takes the embedding, the final norm and the head).
BLOCKS = "layers.*"
#: The modules context parallelism replaces: every block's attention core.
CONTEXT_MODULES = "layers.*.attn.core"


def _expert_style(parallel: JobDims) -> ParallelStyle:
    if parallel.ep_tp:
        return ExpertTensorParallel(mesh_axes=EXPERT_AXES, ep_axis="ep", tp_axis="tp")
    return ExpertParallel()


def model_parallelism(model: ModelConfig, parallel: JobDims) -> ModelParallelism:
    """Which modules of the trainer's Transformer take which style (module docstring)."""
    experts: tuple[str, ...] = ()
    if parallel.ep > 1 and model.moe is not None:
        experts = tuple(
            f"layers.{i}.ffn" for i in range(model.n_layers) if model.moe.is_moe_layer(i)
        )
    return ModelParallelism(
        tp_plan=tuple(tp_plan(model).items()),
        fsdp_units=(BLOCKS,),
        expert_modules=experts,
        expert_style=_expert_style(parallel) if experts else None,
        context_modules=(CONTEXT_MODULES,) if parallel.cp > 1 else (),
    )


def training_policy(config: TrainConfig) -> TrainingPolicy:
    """The parts of ``config`` that change the plan."""
    bf16 = config.mixed_precision == "bf16"
    activation = config.ac if config.ac_budget_bytes is None else "budget"
    if config.swap:
        activation += "+swap"
    return TrainingPolicy(
        optimizer=config.optimizer,
        adamw_patterns=ROUTER_PATTERNS,
        param_dtype="bfloat16" if bf16 else None,
        reduce_dtype="float32" if bf16 else None,
        activation=activation,
        offload=config.offload,
        schedule=config.pp_schedule,
        microbatches=config.microbatches,
        virtual_stages=config.virtual_stages,
    )


def stage_models(
    model: ModelConfig, pp: int, schedule: SchedulePlan | None = None
) -> list[Transformer]:
    """The Transformer on ``meta``, one per pipeline rank (the modules of its stages kept:
    ``schedule.stages_of(rank)`` of the ``schedule.num_stages`` stages, default one stage per
    rank)."""
    models = []
    stages = pp if schedule is None else schedule.num_stages
    boundaries = stage_boundaries(model, stages) if pp > 1 else ()
    for k in range(pp):
        with torch.device("meta"):
            stage = Transformer(model)
        if pp > 1:
            held = (k,) if schedule is None else schedule.stages_of(k)
            keep_stages(stage, held, boundaries)
        models.append(stage)
    return models


def plan_run(model: ModelConfig, parallel: ParallelConfig, config: TrainConfig) -> JobPlan:
    """The plan of the run ``python -m hp_train`` makes with these configs, without any
    process.

    Raises:
        ConfigError: the model cannot be split ``tp`` ways or into ``pp`` stages, or the
            trainer refuses the combination.
    """
    check_model_fits(model, parallel)
    check_combination(model, parallel, config)
    check_virtual_stages_fit(model, parallel, config)
    policy = training_policy(config)
    return plan_job(
        stage_models(model, parallel.pp, plan_schedule(parallel, policy)),
        parallel,
        model_parallelism(model, parallel),
        policy,
    )
