"""``plan_job``: the whole job's plan from meta-device models and configs, without processes.

The algorithm, per pipeline stage ``k`` (its model holds the modules the stage keeps, under
their names in the whole model):

1. The meshes (:func:`hp_planner.meshes.stage_meshes`).
2. The tensor-parallel plan: ``hp_dtensor.parallel.resolve`` of the plan entries that name a
   module of the stage over the stage mesh (``tp`` axis; the data axes ``dp_replicate`` and
   the shard axis); with ``tp == 1`` the same call with no entries (every parameter
   replicated: no plan is applied).
3. Expert parallelism (``ep > 1``): each MoE module resolved alone with the expert style over
   the expert mesh (``ep`` as its style axis, no data axes: FSDP reduces over those).
4. Context parallelism (``cp > 1``): the attention cores it replaces, on the context mesh.
5. FSDP: every ``fully_shard`` call on every FSDP mesh, planned by hp-fsdp
   (:mod:`hp_planner.fsdp_groups`).
6. The optimizer split (``hp_muon.split_params``), recorded on the plan's parameters with
   the stage's first rank's FSDP slots.

Then the pipeline schedule (``pp > 1``). Equal inputs give equal plans: every step is a pure
function of shapes, dtypes, names and rank grids; nothing reads parameter data or a process
group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import ClassVar

from torch import nn

from hp_dtensor.parallel import ParallelPlan, ParallelStyle, resolve
from hp_dtensor.parallel.plan import match_modules
from hp_layout import Topology
from hp_mpmd import SchedulePlan
from hp_mpmd.schedules import (
    dualpipev,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from hp_muon import plan_muon, split_params
from hp_planner.fsdp_groups import plan_fsdp_groups
from hp_planner.inputs import JobDims, ModelParallelism, PlanInputError, TrainingPolicy
from hp_planner.job import ContextPlan, ExpertPlan, JobPlan, MuonView, StagePlan
from hp_planner.meshes import REPLICATE, StageMeshes, job_grid, stage_meshes

__all__ = ["plan_job", "plan_schedule"]

# Each builder takes (pipeline ranks, stages per rank, microbatches).
_SCHEDULES: dict[str, Callable[[int, int, int], SchedulePlan]] = {
    "gpipe": lambda p, _, m: gpipe(p, m),
    "1f1b": lambda p, _, m: one_f_one_b(p, m),
    "zbh1": lambda p, _, m: zero_bubble_h1(p, m),
    "interleaved": interleaved_1f1b,
    "dualpipev": lambda p, _, m: dualpipev(p, m),
}


def plan_job(
    stages: nn.Module | Sequence[nn.Module],
    dims: JobDims,
    parallelism: ModelParallelism,
    training: TrainingPolicy,
    topology: Topology | None = None,
    *,
    ranks: Collection[int] | None = None,
    muon: bool = True,
) -> JobPlan:
    """The :class:`~hp_planner.JobPlan` of a job (module docstring).

    Args:
        stages: the model on ``meta`` (or any device: no data is read), or with ``pp > 1``
            one model per pipeline stage, each keeping its modules under their names in the
            whole model.
        dims: ranks along each axis.
        parallelism: which modules take which style.
        training: the optimizer split, precision, activation/offload and schedule.
        topology: recorded with the plan (the pricing reads it), or None.
        ranks: plan the ``fully_shard`` calls and the Muon steps only on the FSDP meshes
            (and expert FSDP meshes) holding one of these ranks; None plans every mesh. A
            reader that needs a few ranks' view of a large job (the dry run prices one rank
            per tensor-parallel coordinate) saves planning every mesh: the plan of a mesh
            does not depend on which others are planned. Every stage's first rank must be
            among them (its slots fill ``StagePlan.parallel``).
        muon: False leaves ``StagePlan.muon`` empty even under Muon (the optimizer groups
            are still split): for a reader that prices Muon's exchange analytically where
            ``hp_muon.plan_muon`` of every matrix against every rank would take hours.

    Raises:
        PlanInputError: the number of stage models is not ``pp``; a pattern of
            ``parallelism`` names no module of any stage; ``ep > 1`` with no expert module or
            no expert style; ``cp > 1`` with no context module;
            ``ranks`` missing a stage's first rank.
        hp_dtensor.parallel.PlanError: a style cannot shard the module it names.
    """
    models = [stages] if isinstance(stages, nn.Module) else list(stages)
    if len(models) != dims.pp:
        raise PlanInputError(f"pp={dims.pp} needs one model per pipeline stage, got {len(models)}")
    match = _Matcher()
    _check_patterns(models, parallelism, dims, match)
    held = None if ranks is None else frozenset(ranks)
    planned = tuple(
        _plan_stage(k, model, dims, parallelism, training, held, muon, match)
        for k, model in enumerate(models)
    )
    return JobPlan(dims, training, job_grid(dims), planned, plan_schedule(dims, training), topology)


class _Matcher:
    """``hp_dtensor.parallel.plan.match_modules``, each (module tree, pattern) asked once.

    A pattern is checked, then read again per stage, and a model with thousands of modules
    and one expert pattern per MoE layer makes these scans the planning's largest cost. What
    ``match_modules`` returns depends on the tree's module names alone, so the answers are
    kept by those names (one scan of the tree per model per :func:`plan_job` call), shared by
    later calls on trees with the same names (a pricing that plans one model many times).
    """

    _known: ClassVar[dict[tuple[tuple[str, ...], str], list[str]]] = {}
    _LIMIT: ClassVar[int] = 65536

    def __init__(self) -> None:
        self._names: dict[int, tuple[str, ...]] = {}

    def __call__(self, model: nn.Module, pattern: str) -> list[str]:
        names = self._names.get(id(model))
        if names is None:
            names = self._names[id(model)] = tuple(n for n, _ in model.named_modules())
        key = (names, pattern)
        hits = self._known.get(key)
        if hits is None:
            if len(self._known) >= self._LIMIT:
                self._known.clear()
            hits = self._known[key] = match_modules(model, pattern)
        return list(hits)


def _matched(models: Sequence[nn.Module], pattern: str, match: _Matcher) -> bool:
    return any(match(m, pattern) for m in models)


def _check_patterns(
    models: Sequence[nn.Module], parallelism: ModelParallelism, dims: JobDims, match: _Matcher
) -> None:
    kinds = [("fsdp_units", parallelism.fsdp_units)]
    if dims.tp > 1:
        kinds.append(("tp_plan", tuple(k for k, _ in parallelism.tp_plan)))
    if dims.ep > 1:
        if parallelism.expert_style is None or not parallelism.expert_modules:
            raise PlanInputError(
                f"ep={dims.ep} needs expert_modules and an expert_style in ModelParallelism"
            )
        kinds.append(("expert_modules", parallelism.expert_modules))
    if dims.cp > 1:
        if not parallelism.context_modules:
            raise PlanInputError(f"cp={dims.cp} needs context_modules in ModelParallelism")
        kinds.append(("context_modules", parallelism.context_modules))
    for kind, patterns in kinds:
        for pattern in patterns:
            if not _matched(models, pattern, match):
                raise PlanInputError(
                    f"{kind} entry {pattern!r} names no module of any stage (patterns match "
                    "one dotted name component per '*', e.g. 'layers.*')"
                )


def _names(model: nn.Module, patterns: Sequence[str], match: _Matcher) -> tuple[str, ...]:
    """The modules of ``model`` the ``patterns`` match, in module order, each once."""
    hits = {name for p in patterns for name in match(model, p)}
    return tuple(name for name, _ in model.named_modules() if name in hits)


def _tp_plan(
    model: nn.Module,
    meshes: StageMeshes,
    dims: JobDims,
    parallelism: ModelParallelism,
    match: _Matcher,
) -> ParallelPlan:
    entries: dict[str, ParallelStyle] = {}
    if dims.tp > 1:
        entries = {k: s for k, s in parallelism.tp_plan if match(model, k)}
    axes = (REPLICATE, meshes.shard_axis)
    return resolve(model, meshes.stage, entries, mode="production", tp_axis="tp", dp_axes=axes)


def _expert_plans(
    model: nn.Module, meshes: StageMeshes, parallelism: ModelParallelism, match: _Matcher
) -> tuple[ExpertPlan, ...]:
    if meshes.expert is None:
        return ()
    style = parallelism.expert_style
    assert style is not None  # _check_patterns
    return tuple(
        ExpertPlan(
            name,
            resolve(
                model.get_submodule(name),
                meshes.expert,
                {"": style},
                mode="production",
                tp_axis="ep",
                dp_axes=(),
            ),
        )
        for name in _names(model, parallelism.expert_modules, match)
    )


def _optimizer_groups(model: nn.Module, training: TrainingPolicy) -> dict[str, str]:
    """Each trainable parameter's optimizer, in ``named_parameters`` order."""
    if training.optimizer == "adamw":
        return {name: "adamw" for name, p in model.named_parameters() if p.requires_grad}
    split = split_params(model, adamw_patterns=training.adamw_patterns)
    groups = {name: "adamw" for name, _ in split.adamw}
    groups.update({name: "muon" for name, _ in split.muon})
    return groups


def _muon_views(
    meshes: StageMeshes,
    stage: StagePlan,
    groups: dict[str, str],
    world: int,
    held: frozenset[int] | None,
) -> tuple[MuonView, ...]:
    """The Muon step of each FSDP mesh's ranks: ``hp_muon.plan_muon`` of the Muon parameters
    (in the order ``hp_muon.split_params`` gives them to Muon) with their sharded layouts, its
    exchanges over the default process group (every rank of the job)."""
    names = [name for name, group in groups.items() if group == "muon"]
    if not names:
        return ()
    views = []
    for mesh in meshes.fsdp_meshes():
        if held is not None and held.isdisjoint(mesh.ranks):
            continue
        layouts = stage.layouts(mesh.ranks[0])
        params = [(name, layouts[name]) for name in names]
        plan = plan_muon(params, group_ranks=range(world), rank=mesh.ranks[0])
        views.append(MuonView(mesh.ranks, plan))
    return tuple(views)


def _plan_stage(
    k: int,
    model: nn.Module,
    dims: JobDims,
    parallelism: ModelParallelism,
    training: TrainingPolicy,
    held: frozenset[int] | None,
    muon: bool,
    match: _Matcher,
) -> StagePlan:
    meshes = stage_meshes(dims, k)
    tp = _tp_plan(model, meshes, dims, parallelism, match)
    experts = _expert_plans(model, meshes, parallelism, match)
    context = None
    if meshes.context is not None:
        modules = _names(model, parallelism.context_modules, match)
        context = ContextPlan(dims.cp_variant, modules, meshes.context)
    units = _names(model, parallelism.fsdp_units, match)
    first = min(meshes.stage.ranks)
    if held is not None and first not in held:
        raise PlanInputError(
            f"ranks must hold stage {k}'s first rank {first} (its slots fill the stage's "
            f"parallel plan), got {sorted(held)[:8]}"
        )
    fsdp = plan_fsdp_groups(
        model, meshes, units, tp if dims.tp > 1 else None, experts, training, held
    )
    slots = {}
    for group in fsdp:
        if first in group.mesh:
            slots.update(group.flat_slots())
    groups = _optimizer_groups(model, training)
    parallel = tp.with_flat_slots(slots).with_optimizer_groups(groups)
    activation = (training.activation, units if training.activation != "none" else ())
    stage = StagePlan(k, meshes, parallel, experts, context, fsdp, (), activation, training.offload)
    if not muon:
        return stage
    return replace(stage, muon=_muon_views(meshes, stage, groups, dims.world_size, held))


def plan_schedule(dims: JobDims, training: TrainingPolicy) -> SchedulePlan | None:
    """The pipeline's schedule as :func:`plan_job` records it (``JobPlan.schedule``):
    ``training.schedule`` over ``dims.pp`` ranks, ``training.virtual_stages`` stages each
    (``pp x virtual_stages`` stages) and ``training.microbatches`` microbatches; None without
    pipelining. A reader that needs only the schedule (a pricing that varies the
    microbatches) takes it here without planning the whole job.

    Raises:
        PlanInputError: a microbatch count the schedule cannot run (``interleaved``: not a
            multiple of ``pp``; ``dualpipev``: under ``2 pp``), the message naming valid ones.
    """
    if dims.pp == 1:
        return None
    build = _SCHEDULES[training.schedule]
    try:
        return build(dims.pp, training.stages_per_rank, training.microbatches)
    except ValueError as exc:
        raise PlanInputError(f"pp_schedule {training.schedule!r}: {exc}") from None
