"""Pipeline parallelism in the training entry point: the Transformer cut into stages and run by
hp-mpmd's runtime.

Stage ``s`` keeps the blocks ``boundaries[s] <= i < boundaries[s + 1]`` under their global
names (``layers.<i>``), stage 0 also the embedding and the last stage the final norm and the
head, so checkpoints and plans name every parameter as in the whole model. The split balances
the blocks' parameter counts (an MoE block weighs more than a dense one).

Schedules: ``gpipe``, ``1f1b`` and ``zbh1`` run one stage per pipeline rank; ``interleaved``
(``pp_virtual_stages`` v, default 2) and ``dualpipev`` (2) cut ``pp x v`` stages and give each
rank the ones the plan places there (:mod:`hp_train.parallel.virtual`: one model per rank,
one view per stage). ZB-H1 and DualPipeV split backwards into an input pass and a weight pass:
FSDP's gradient reduction is held through the input pass and runs after the weight pass,
whose walk of the graph unshards the parameters again (one more all-gather per split
backward).

Each pipeline stage is a group of ``dp_replicate x dp_shard x tp`` ranks: tensor parallelism
and FSDP run inside the stage exactly as without pipelining; every data-parallel replica runs
its own pipeline (the stage's ``tp`` ranks form one plan rank of hp-mpmd's
:class:`~hp_mpmd.StagePlacement`), and FSDP reduces the gradients over the data axes: a
reduce-scatter over ``dp_shard`` after every microbatch, the HSDP all-reduce over
``dp_replicate`` once per step (after the last microbatch), and with gradient accumulation
(``grad_accum`` pipeline steps per optimizer step) after the last microbatch of the last one.

Evaluation runs the forward half of the same plan (:func:`hp_mpmd.schedules.forward_only`) on
the same stages: held-out losses and the divergence probe under pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_fsdp import FSDPModule
from hp_layout import Mesh
from hp_mpmd import (
    PipelineSchedule,
    PipelineStage,
    SchedulePlan,
    StagePlacement,
    balanced_boundaries,
    parameter_costs,
)
from hp_mpmd.schedules import forward_only
from hp_planner import JobDims, PlanInputError, TrainingPolicy, plan_schedule
from hp_train.config.schema import PIPELINE_SCHEDULE_NAMES, ConfigError, ModelConfig
from hp_train.model.llama import Transformer, lm_loss
from hp_train.parallel.virtual import StagedTransformer, StageView, keep_stages, stage_parts

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineRunner",
    "build_pipeline",
    "keep_stage",
    "stage_boundaries",
]


def _default_plan(schedule: str) -> Callable[[int, int], SchedulePlan]:
    def build(pp: int, microbatches: int) -> SchedulePlan:
        plan = plan_schedule(
            JobDims(pp=pp), TrainingPolicy(schedule=schedule, microbatches=microbatches)
        )
        assert plan is not None, "a pipeline has pp > 1"
        return plan

    return build


#: The schedules the entry point offers, each as ``build(pp, microbatches)`` at its default
#: virtual stages per rank (hp-planner's :func:`~hp_planner.plan_schedule`, which the run's
#: JobPlan records). ZB-H1 and DualPipeV split backwards into an input and a weight pass: FSDP
#: holds its gradient reduction until the weight pass (``before_input_gradients``).
PIPELINE_SCHEDULES: dict[str, Callable[[int, int], SchedulePlan]] = {
    name: _default_plan(name) for name in PIPELINE_SCHEDULE_NAMES
}


def stage_boundaries(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """Block indices where the ``pp`` stages start (and the end), balanced by parameters
    (:func:`hp_train.parallel.parallelize.check_model_fits` refuses fewer blocks than stages first).
    """
    with torch.device("meta"):
        whole = Transformer(model)
    return balanced_boundaries(parameter_costs(list(whole.layers.items())), pp)


def keep_stage(model: Transformer, stage: int, boundaries: tuple[int, ...]) -> Transformer:
    """Drop from ``model`` (in place) everything stage ``stage`` does not run (one stage per
    rank: :func:`~hp_train.parallel.virtual.keep_stages` of that stage)."""
    return keep_stages(model, (stage,), boundaries)


class _FinalMicroStep:
    """Whether the pipeline step running now is the optimizer step's last (gradient
    accumulation runs several), read by the weight-gradient hook."""

    def __init__(self) -> None:
        self.final = True

    def __call__(self, stage: PipelineStage, last: bool) -> None:
        """Under HSDP, every microbatch's backward reduce-scatters over the shard axis, and
        only the optimizer step's last one all-reduces over the replicate (slow) axis, on the
        sum. The weight pass of a split backward reduces (see :meth:`before_input`)."""
        root = _fsdp_root(stage)
        if root is not None:
            root.set_requires_gradient_sync(True)
            root.set_requires_all_reduce(last and self.final)

    @staticmethod
    def before_input(stage: PipelineStage) -> None:
        """A split backward's input pass computes no weight gradient: FSDP must not reduce
        after it (its end-of-backward callback would reduce-scatter empty gradients), but
        after the weight pass, which walks the graph again (FSDP's pre-backward hooks unshard
        the parameters again for it)."""
        root = _fsdp_root(stage)
        if root is not None:
            root.set_requires_gradient_sync(False)


def _fsdp_root(stage: PipelineStage) -> FSDPModule | None:
    """The FSDP root that holds ``stage``'s parameters: the stage's module, or the rank's model
    a :class:`~hp_train.parallel.virtual.StageView` runs; None without FSDP."""
    module = stage.module.root if isinstance(stage.module, StageView) else stage.module
    return module if isinstance(module, FSDPModule) else None


@dataclass(frozen=True)
class PipelineRunner:
    """This rank's pipeline.

    Attributes:
        schedule: hp-mpmd's executor of the plan.
        evaluator: the executor of the plan's forward half (no gradients), on the same stages.
        stage: this rank's position on the pipeline axis (its pipeline rank; with virtual
            stages the rank runs the stages ``schedule.stages`` holds).
        num_stages: pipeline ranks (``pp``).
        pp_group: the ranks that run the other stages of this rank's position in the data and
            tensor-parallel grid (to combine per-stage quantities such as gradient norms).
        micro_step: the flag :meth:`step` sets for the weight-gradient hook.
    """

    schedule: PipelineSchedule
    evaluator: PipelineSchedule
    stage: int
    num_stages: int
    pp_group: dist.ProcessGroup
    micro_step: _FinalMicroStep

    @property
    def is_first(self) -> bool:
        """This rank runs the embedding (stage 0: it reads the inputs)."""
        return 0 in self.schedule.stages

    @property
    def is_last(self) -> bool:
        """This rank runs the head (the last stage: it computes the loss; DualPipeV's first
        pipeline rank, interleaved 1F1B's last)."""
        return self.schedule.plan.num_stages - 1 in self.schedule.stages

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, final: bool = True) -> float:
        """Forward and backward of every microbatch; this rank's local loss (the mean over the
        microbatches on the last stage, 0.0 on the others). ``final``: the optimizer step's
        last pipeline step (False for the earlier micro-steps of gradient accumulation, whose
        gradients HSDP does not all-reduce over the replicas yet)."""
        self.micro_step.final = final
        try:
            result = self.schedule.step(
                inputs if self.is_first else None, targets if self.is_last else None
            )
        finally:
            self.micro_step.final = True
        if not self.is_last:
            return 0.0
        losses = [float(v) for v in result.losses]
        return sum(losses) / len(losses)

    def forward_losses(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """The mean loss of the batch's microbatches, forward only (evaluation; call under
        ``torch.no_grad()`` with the modules in eval mode), on the last stage; None on the
        other stages. Collective over the pipeline's ranks."""
        result = self.evaluator.step(
            inputs if self.is_first else None, targets if self.is_last else None
        )
        if not self.is_last:
            return None
        losses = [float(v) for v in result.losses]
        return sum(losses) / len(losses)


def _stage_groups(grid: Mesh, rank: int) -> tuple[tuple[int, ...], ...]:
    """Per stage, the global ranks that form ``rank``'s plan rank of hp-mpmd's
    :class:`~hp_mpmd.StagePlacement` on ``grid`` (axes ``pp`` first, ``tp`` last, the data and
    context axes between): the stage's ``tp`` ranks at ``rank``'s coordinates on every other
    axis. So each data-parallel replica runs a pipeline of its own, and a context-parallel
    rank's columns (its slice of every sequence) go to the same ``cp`` coordinate of the next
    stage, and their gradient comes back from it."""
    if grid.axis_names[0] != "pp" or grid.axis_names[-1] != "tp":
        raise ValueError(f"a pipeline grid has axes pp first and tp last, got {grid!r}")
    coordinate = list(grid.coordinate(rank))
    groups = []
    for s in range(grid.shape[0]):
        group = []
        for t in range(grid.shape[-1]):
            coordinate[0], coordinate[-1] = s, t
            group.append(grid.rank_at(coordinate))
        groups.append(tuple(group))
    return tuple(groups)


def _rank_stages(
    module: Transformer, plan: SchedulePlan, rank: int, device: torch.device
) -> list[PipelineStage]:
    """The runtime's stages of pipeline rank ``rank``: ``module`` itself with one stage per
    rank, a view per stage with several."""
    held = plan.stages_of(rank)
    if len(held) == 1:
        return [PipelineStage(module, held[0], plan.num_stages, device=device)]
    if not isinstance(module, StagedTransformer):
        raise ConfigError(
            f"plan {plan.name!r} runs stages {list(held)} on pipeline rank {rank}: the rank's "
            f"model must be a StagedTransformer (hp_train.parallel.virtual), got "
            f"{type(module).__name__}"
        )
    boundaries = stage_boundaries(module.config, plan.num_stages)
    return [
        PipelineStage(StageView(module, part), part.index, plan.num_stages, device=device)
        for part in stage_parts(held, boundaries)
    ]


def build_pipeline(
    module: Transformer,
    mesh: DeviceMesh,
    *,
    schedule: str,
    microbatches: int,
    device: torch.device,
    virtual_stages: int = 1,
) -> PipelineRunner:
    """The pipeline of this rank's ``module`` over ``mesh`` (axes ``pp`` first, then
    ``dp_replicate``, ``dp_shard``, ``tp``); collective over the world.

    With ``virtual_stages`` v > 1, ``module`` is a
    :class:`~hp_train.parallel.virtual.StagedTransformer` keeping the blocks of the v stages
    the plan places on this rank (of ``pp x v`` cut by :func:`stage_boundaries`), and the
    runtime gets one :class:`~hp_train.parallel.virtual.StageView` per stage.

    Raises:
        ConfigError: an unknown schedule name, a count of virtual stages or microbatches the
            schedule cannot run, or (v > 1) a module that is not a StagedTransformer.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {schedule!r}; choose one of {sorted(PIPELINE_SCHEDULES)}"
        )
    grid = mesh.mesh
    pp = grid.shape[0]
    rank = dist.get_rank()
    stage = grid.coordinate(rank)[0]
    try:
        policy = TrainingPolicy(
            schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages
        )
        plan = plan_schedule(JobDims(pp=pp), policy)
    except PlanInputError as exc:
        raise ConfigError(str(exc)) from None
    assert plan is not None, "a pipeline has pp > 1"
    stages = _rank_stages(module, plan, stage, device)
    groups = _stage_groups(grid, rank)
    # A tensor-parallel stage hands its input gradient back whole on every tp rank (summed
    # over tp inside the fast tier by hp-dtensor): one rank of the next stage sends it.
    placement = StagePlacement(groups)
    micro_step = _FinalMicroStep()
    runner = PipelineSchedule(
        plan,
        stages,
        lm_loss,
        placement=placement,
        before_weight_gradients=micro_step,
        before_input_gradients=micro_step.before_input,
    )
    evaluator = PipelineSchedule(
        forward_only(plan), stages, lm_loss, placement=placement, forward_only=True
    )
    return PipelineRunner(runner, evaluator, stage, pp, mesh.get_group("pp"), micro_step)
