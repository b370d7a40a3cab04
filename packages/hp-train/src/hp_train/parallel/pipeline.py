"""Pipeline parallelism in the training entry point: the Transformer cut into stages and run by
hp-mpmd's runtime.

Stage ``s`` keeps the blocks ``boundaries[s] <= i < boundaries[s + 1]`` under their global
names (``layers.<i>``), stage 0 also the embedding and the last stage the final norm and the
head, so checkpoints and plans name every parameter as in the whole model. The split balances
the blocks' parameter counts (an MoE block weighs more than a dense one).

Each pipeline stage is a group of ``dp_replicate x dp_shard x tp`` ranks: tensor parallelism
and FSDP run inside the stage exactly as without pipelining; every data-parallel replica runs
its own pipeline (the stage's ``tp`` ranks form one plan rank of hp-mpmd's
:class:`~hp_mpmd.StagePlacement`), and FSDP reduces the gradients over the data axes: a
reduce-scatter over ``dp_shard`` after every microbatch, the HSDP all-reduce over
``dp_replicate`` once per step (after the last microbatch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_fsdp import FSDPModule
from hp_mpmd import (
    PipelineSchedule,
    PipelineStage,
    SchedulePlan,
    StagePlacement,
    balanced_boundaries,
    parameter_costs,
)
from hp_mpmd.schedules import gpipe, one_f_one_b
from hp_train.config.schema import ConfigError, ModelConfig
from hp_train.model.llama import Transformer, lm_loss

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineRunner",
    "build_pipeline",
    "keep_stage",
    "stage_boundaries",
]

#: The schedules the entry point offers (one stage per pipeline rank). Zero bubble (ZB-H1) is
#: not among them: its split backward (input pass, then weight pass) runs before FSDP's
#: gradient hooks can tell when a parameter's gradient is complete.
PIPELINE_SCHEDULES: dict[str, Callable[[int, int], SchedulePlan]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def stage_boundaries(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """Block indices where the ``pp`` stages start (and the end), balanced by parameters
    (:func:`hp_train.parallel.parallelize.check_model_fits` refuses fewer blocks than stages first).
    """
    with torch.device("meta"):
        whole = Transformer(model)
    return balanced_boundaries(parameter_costs(list(whole.layers.items())), pp)


def keep_stage(model: Transformer, stage: int, boundaries: tuple[int, ...]) -> Transformer:
    """Drop from ``model`` (in place) everything stage ``stage`` does not run."""
    first, end = boundaries[stage], boundaries[stage + 1]
    for key in list(model.layers.keys()):
        if not first <= int(key) < end:
            del model.layers[key]
    if stage > 0:
        model.tok_embeddings = None
    if stage < len(boundaries) - 2:
        model.norm = None
        model.output = None
    return model


@dataclass(frozen=True)
class PipelineRunner:
    """This rank's pipeline.

    Attributes:
        schedule: hp-mpmd's executor of the plan.
        stage: the stage this rank runs.
        num_stages: stages of the pipeline.
        pp_group: the ranks that run the other stages of this rank's position in the data and
            tensor-parallel grid (to combine per-stage quantities such as gradient norms).
    """

    schedule: PipelineSchedule
    stage: int
    num_stages: int
    pp_group: dist.ProcessGroup

    @property
    def is_first(self) -> bool:
        """This rank runs the embedding (it reads the inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This rank runs the head (it computes the loss)."""
        return self.stage == self.num_stages - 1

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of every microbatch; this rank's local loss (the mean over the
        microbatches on the last stage, 0.0 on the others)."""
        result = self.schedule.step(
            inputs if self.is_first else None, targets if self.is_last else None
        )
        if not self.is_last:
            return 0.0
        losses = [float(v) for v in result.losses]
        return sum(losses) / len(losses)


def _all_reduce_on_the_last_microbatch(stage: PipelineStage, last: bool) -> None:
    """Under HSDP, every microbatch's backward reduce-scatters over the shard axis, and only
    the step's last one all-reduces over the replicate (slow) axis, on the sum."""
    if isinstance(stage.module, FSDPModule):
        stage.module.set_requires_all_reduce(last)


def build_pipeline(
    module: Transformer,
    mesh: DeviceMesh,
    *,
    schedule: str,
    microbatches: int,
    device: torch.device,
) -> PipelineRunner:
    """The pipeline of this rank's stage ``module`` over ``mesh`` (axes ``pp`` first, then
    ``dp_replicate``, ``dp_shard``, ``tp``); collective over the world.

    Raises:
        ConfigError: an unknown schedule name.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"unknown pipeline schedule {schedule!r}; choose one of {sorted(PIPELINE_SCHEDULES)}"
        )
    grid = mesh.mesh
    pp, _, _, tp = grid.shape
    rank = dist.get_rank()
    stage, replica, shard, _ = grid.coordinate(rank)
    plan = PIPELINE_SCHEDULES[schedule](pp, microbatches)
    groups = tuple(
        tuple(grid.rank_at((s, replica, shard, t)) for t in range(tp)) for s in range(pp)
    )
    # A tensor-parallel stage hands its input gradient back whole on every tp rank (summed
    # over tp inside the fast tier by hp-dtensor): one rank of the next stage sends it.
    placement = StagePlacement(groups)
    runner = PipelineSchedule(
        plan,
        [PipelineStage(module, stage, pp, device=device)],
        lm_loss,
        placement=placement,
        before_weight_gradients=_all_reduce_on_the_last_microbatch,
    )
    return PipelineRunner(runner, stage, pp, mesh.get_group("pp"))
