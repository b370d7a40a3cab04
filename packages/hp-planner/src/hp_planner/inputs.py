"""What :func:`hp_planner.plan_job` reads besides the model: frozen, comparable by value.

Three inputs, each owned by the party who knows it:

* :class:`JobDims`: how many ranks along each parallel axis (the launcher's choice);
* :class:`ModelParallelism`: which modules of *this model* take which style (the model
  author's choice: a tensor-parallel plan by module pattern, the modules ``fully_shard`` is
  called on, the MoE modules and the attention cores);
* :class:`TrainingPolicy`: the optimizer split, precision, activation and offload policy and
  the pipeline schedule (the training recipe's choice).

Patterns match module names one dotted component at a time (``*`` is one component), as
``hp_dtensor.parallel.parallelize_module`` matches plan keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hp_dtensor.parallel import ParallelStyle

__all__ = ["CP_VARIANTS", "JobDims", "ModelParallelism", "PlanInputError", "TrainingPolicy"]

#: Context-parallel attentions (``hp_dtensor.parallel.ContextParallel``'s variants).
CP_VARIANTS = ("ring", "ulysses")
#: Optimizers a plan knows how to split parameters for.
OPTIMIZERS = ("muon", "adamw")
#: Pipeline schedules with one stage per pipeline rank (``hp_mpmd.schedules``).
SCHEDULES = ("1f1b", "gpipe")


class PlanInputError(ValueError):
    """An input :func:`hp_planner.plan_job` cannot plan (the message names it and what would
    be right)."""


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class JobDims:
    """Ranks along each axis: ``pp x dp_replicate x dp_shard x cp x tp``.

    The rank grid is ``(pp, dp_replicate, dp_shard, cp, tp)``, ``tp`` innermost (the fastest
    links), axes of size 1 left out. Tensor parallelism and FSDP see ``dp_shard x cp`` as one
    shard axis (``dp_shard_cp``) when ``cp > 1``; expert parallelism carves ``ep`` from
    ``dp_shard`` (``(dp_replicate, expert_shard, ep, tp)`` over the same ranks).

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's replicate axis).
        dp_shard: FSDP shards.
        tp: tensor-parallel ranks.
        pp: pipeline stages (the outermost axis).
        cp: context-parallel ranks.
        cp_variant: ``"ring"`` or ``"ulysses"``.
        ep: expert-parallel ranks, a divisor of ``dp_shard``.
        ep_tp: each expert's hidden dim split over ``tp`` as well.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_variant: str = "ring"
    ep: int = 1
    ep_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            _positive(name, getattr(self, name))
        if self.cp_variant not in CP_VARIANTS:
            raise PlanInputError(
                f"cp_variant must be one of {CP_VARIANTS}, got {self.cp_variant!r}"
            )
        if self.dp_shard % self.ep:
            raise PlanInputError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard}: the expert-parallel ranks "
                "are carved from the FSDP shard axis"
            )

    @property
    def world_size(self) -> int:
        """Ranks the job needs."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards): how many ways the batch is split."""
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class ModelParallelism:
    """Which modules take which style.

    Attributes:
        tp_plan: tensor-parallel styles by module pattern, applied on each stage's mesh over
            its ``tp`` axis when ``tp > 1`` (an entry matching no module of a stage is left
            out of that stage's plan; one matching no module of any stage is an error).
        fsdp_units: patterns of the modules ``fully_shard`` is called on, in call order,
            before the stage's root (which is always sharded last and takes the rest).
        expert_modules: patterns of the MoE modules: with ``ep > 1`` each is sharded by
            ``expert_style`` over the expert mesh and is an FSDP group of its own over the
            ranks holding the same experts, made before its enclosing unit's group.
        expert_style: the expert-parallel style (with ``ep > 1``).
        context_modules: patterns of the attention cores context parallelism replaces
            (with ``cp > 1``; parameter-free).
    """

    tp_plan: tuple[tuple[str, ParallelStyle], ...] = ()
    fsdp_units: tuple[str, ...] = ()
    expert_modules: tuple[str, ...] = ()
    expert_style: ParallelStyle | None = None
    context_modules: tuple[str, ...] = ()

    @staticmethod
    def of(tp_plan: Mapping[str, ParallelStyle], **rest: object) -> ModelParallelism:
        """From a tensor-parallel plan as a mapping (the form ``parallelize_module`` takes)."""
        return ModelParallelism(tuple(tp_plan.items()), **rest)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TrainingPolicy:
    """The parts of the training recipe that change the plan.

    Attributes:
        optimizer: ``"muon"`` (Muon on matrices by ``hp_muon.split_params``, AdamW on the
            rest) or ``"adamw"`` (AdamW on everything).
        adamw_patterns: parameter patterns kept on AdamW under Muon (e.g. MoE routers).
        param_dtype: FSDP's compute dtype of the unsharded parameters (mixed precision), None
            for the storage dtype.
        reduce_dtype: the dtype gradients are reduced in, None for ``param_dtype``'s.
        activation: the activation policy of the FSDP units (``"none"``, ``"full"``,
            ``"selective"``, ``"swap"``...: recorded as given, executed by the trainer).
        offload: what lives on the host (``"none"``, ``"params"``, ``"optimizer"``,
            ``"both"``).
        schedule: the pipeline schedule with ``pp > 1`` (``"gpipe"`` or ``"1f1b"``).
        microbatches: pipeline microbatches per step.
    """

    optimizer: str = "muon"
    adamw_patterns: tuple[str, ...] = ()
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation: str = "none"
    offload: str = "none"
    schedule: str = "1f1b"
    microbatches: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise PlanInputError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise PlanInputError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _positive("microbatches", self.microbatches)
