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

__all__ = [
    "CP_VARIANTS",
    "DEFAULT_VIRTUAL_STAGES",
    "JobDims",
    "ModelParallelism",
    "PlanInputError",
    "TrainingPolicy",
    "check_virtual_stages",
    "expert_carving_problem",
]

#: Context-parallel attentions (``hp_dtensor.parallel.ContextParallel``'s variants).
CP_VARIANTS = ("ring", "ulysses")
#: Optimizers a plan knows how to split parameters for.
OPTIMIZERS = ("muon", "adamw")
#: Pipeline schedules (``hp_mpmd.schedules``): ``gpipe``, ``1f1b`` and ``zbh1`` (ZB-H1, split
#: backward) run one stage per pipeline rank; ``interleaved`` (interleaved 1F1B) any number of
#: virtual stages per rank, ``dualpipev`` two (the V: stage ``s`` and ``2 pp - 1 - s``).
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbh1", "dualpipev")
#: Virtual stages per pipeline rank of each schedule when not given.
DEFAULT_VIRTUAL_STAGES = {"1f1b": 1, "gpipe": 1, "interleaved": 2, "zbh1": 1, "dualpipev": 2}


def check_virtual_stages(schedule: str, virtual_stages: int) -> None:
    """Raise :class:`PlanInputError` unless ``schedule`` runs ``virtual_stages`` stages per
    pipeline rank: any positive count for ``interleaved``, 2 for ``dualpipev``, 1 for the
    others (the message names the count that works)."""
    _positive("virtual_stages", virtual_stages)
    if schedule == "interleaved" or virtual_stages == DEFAULT_VIRTUAL_STAGES.get(schedule):
        return
    raise PlanInputError(
        f"schedule {schedule!r} runs {DEFAULT_VIRTUAL_STAGES.get(schedule)} stage(s) per "
        f"pipeline rank, got virtual_stages={virtual_stages}; only 'interleaved' takes another "
        "count"
    )


class PlanInputError(ValueError):
    """An input :func:`hp_planner.plan_job` cannot plan (the message names it and what would
    be right)."""


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError(f"{name} must be a positive integer, got {value!r}")


def expert_carving_problem(dp_shard: int, cp: int, ep: int) -> str | None:
    """Why ``ep`` expert-parallel ranks cannot be carved from the FSDP shard axis of
    ``dp_shard x cp`` ranks (None when they can): ``ep`` must divide ``dp_shard x cp``, and
    with ``ep > 1`` and ``cp > 1`` be a multiple of ``cp`` (the ep axis is the shard axis's
    innermost part, so it takes whole context-parallel groups)."""
    if ep == 1:
        return None
    if cp == 1:
        if dp_shard % ep:
            return (
                f"ep={ep} must divide dp_shard={dp_shard}: the expert-parallel ranks are carved "
                "from the FSDP shard axis"
            )
        return None
    if ep % cp or (dp_shard * cp) % ep:
        return (
            f"ep={ep} with cp={cp} must be a multiple of cp dividing dp_shard x cp = "
            f"{dp_shard * cp}: the expert-parallel ranks are carved from the FSDP shard axis "
            "dp_shard x cp, each group taking whole context-parallel groups"
        )
    return None


@dataclass(frozen=True)
class JobDims:
    """Ranks along each axis: ``pp x dp_replicate x dp_shard x cp x tp``.

    The rank grid is ``(pp, dp_replicate, dp_shard, cp, tp)``, ``tp`` innermost (the fastest
    links), axes of size 1 left out. Tensor parallelism and FSDP see ``dp_shard x cp`` as one
    shard axis (``dp_shard_cp``) when ``cp > 1``; expert parallelism carves ``ep`` from that
    shard axis, innermost (``(dp_replicate, expert_shard, ep, tp)`` over the same ranks), so
    under context parallelism each expert-parallel group takes whole context-parallel groups
    (``cp`` divides ``ep``), as torchtitan lays it out.

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's replicate axis).
        dp_shard: FSDP shards.
        tp: tensor-parallel ranks.
        pp: pipeline stages (the outermost axis).
        cp: context-parallel ranks.
        cp_variant: ``"ring"`` or ``"ulysses"``.
        ep: expert-parallel ranks, a divisor of ``dp_shard x cp`` and with ``cp > 1`` a
            multiple of ``cp`` (:func:`expert_carving_problem`).
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
        problem = expert_carving_problem(self.dp_shard, self.cp, self.ep)
        if problem is not None:
            raise PlanInputError(problem)

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
        schedule: the pipeline schedule with ``pp > 1`` (one of :data:`SCHEDULES`).
        microbatches: pipeline microbatches per step.
        virtual_stages: pipeline stages per pipeline rank (the model is cut into
            ``pp x virtual_stages`` stages): 1 but for ``interleaved`` (any) and
            ``dualpipev`` (2); None: the schedule's :data:`DEFAULT_VIRTUAL_STAGES`.
    """

    optimizer: str = "muon"
    adamw_patterns: tuple[str, ...] = ()
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation: str = "none"
    offload: str = "none"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise PlanInputError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise PlanInputError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _positive("microbatches", self.microbatches)
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", DEFAULT_VIRTUAL_STAGES[self.schedule])
        check_virtual_stages(self.schedule, self.stages_per_rank)

    @property
    def stages_per_rank(self) -> int:
        """``virtual_stages`` resolved (never None after construction)."""
        assert self.virtual_stages is not None
        return self.virtual_stages
