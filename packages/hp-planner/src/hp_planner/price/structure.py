"""What the pricing reads of the parameters, from the model's JobPlan: shapes,
tensor-parallel placement, optimizer, the FSDP groups as flat-buffer layouts, every
parameter's layout.

The pricing plans nothing itself. :func:`job_plan` is the :class:`hp_planner.JobPlan` of a
:class:`~hp_planner.price.model.PricedModel` (its stage models on ``meta``, its model
parallelism, its training policy with Muon's optimizer split), cached per model and degrees
because the search prices many layouts, each several times, and planned only where it is
read:

* on the FSDP meshes holding the priced rank and each stage's first rank
  (:func:`priced_ranks`), through ``plan_job(ranks=)``: a 768-rank job plans two meshes, not
  hundreds;
* without the Muon step (``plan_job(muon=False)``) unless the exact Muon figures are asked
  for (:mod:`hp_planner.price.muon_traffic`);
* with the meta models in the priced storage dtype, so hp-fsdp aligns the buffers in it.

From it: :func:`model_parameters` (each trainable parameter's global shape, optimizer group
and the dim its ``Shard`` on ``tp`` takes in the resolved plan, at ``tp = 2`` where every
style shards), :func:`fsdp_groups` (hp-fsdp's :class:`~hp_fsdp.GroupPlan` of every
``fully_shard`` call on the FSDP mesh of one tensor-parallel coordinate: parameters in buffer
order, packed local shapes, the flat buffer, the tail reduced over ``tp`` or ``ep``),
:func:`predicted_layouts` (``StagePlan.layouts``: what ``hp_dtensor.contract.layout_of``
reports once the executors have laid the model out),
:func:`planned_model` (the stage's parallel plan with the rank's flat slots and optimizer
groups: what ``hp-dryrun --print-plan`` prints), :func:`resolved_plan` (the same without
them) and :func:`tp_collectives` (the plan's boundaries). The fits check is the model's
(``PricedModel.check_fits``: a trainer's own); pipeline stages keep the blocks
``PricedModel.stage_boundaries`` gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn

from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import GroupPlan, plan_group
from hp_fsdp import ParamSpec as FSDPParamSpec
from hp_layout import FlatBufferLayout, Layout, Mesh, Shard, chunk_length
from hp_planner.inputs import JobDims, PlanInputError
from hp_planner.job import FsdpGroup, JobPlan, StagePlan
from hp_planner.meshes import stage_of
from hp_planner.plan_job import plan_job
from hp_planner.price.model import PricedModel, PricingError

__all__ = [
    "GroupSpec",
    "ParamSpec",
    "check_fits",
    "check_tp",
    "fsdp_groups",
    "job_plan",
    "model_parameters",
    "parameter_count",
    "planned_model",
    "predicted_layouts",
    "priced_ranks",
    "rank_stage",
    "resolved_plan",
    "stage_layers",
    "tp_collectives",
    "tp_dim_of",
]

_TP = "tp"
_SHARD = "dp_shard"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model.

    Attributes:
        name: its fully qualified name (``layers.3.attn.q_proj.weight``).
        shape: its global shape.
        optimizer: ``"muon"`` or ``"adamw"`` (by :func:`hp_muon.split_params`).
        tp_dim: the dim tensor parallelism shards (its ``Shard`` on ``tp`` in the resolved
            plan), or None when replicated over it.
    """

    name: str
    shape: tuple[int, ...]
    optimizer: str
    tp_dim: int | None

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_shape(self, tp: int, coordinate: int = 0) -> tuple[int, ...]:
        """Its shape on tensor-parallel coordinate ``coordinate`` of ``tp`` (chunk semantics,
        as ``hp_layout.Layout.local_shape`` of its resolved layout)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        dims = list(self.shape)
        dims[self.tp_dim] = chunk_length(dims[self.tp_dim], tp, coordinate)
        return tuple(dims)


def tp_dim_of(layout: Layout, axis: str = _TP) -> int | None:
    """The tensor dim ``layout`` shards over mesh axis ``axis`` (None: not sharded there)."""
    placement = layout.placement(axis)
    return placement.dim if isinstance(placement, Shard) else None


# The job's plan --------------------------------------------------------------------------------

#: Storage dtypes by element size: the meta models are cast to it before planning, so hp-fsdp
#: packs and aligns each buffer in the dtype the dry run prices (``Precision.param``).
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@lru_cache(maxsize=16)
def _stage_models(model: PricedModel, pp: int, param_bytes: int) -> tuple[nn.Module, ...]:
    """The model's stage models on ``meta`` in the storage dtype, built once per model
    (planning reads them and changes nothing)."""
    dtype = _DTYPES.get(param_bytes)
    if dtype is None:
        raise PricingError(f"param_bytes must be one of {sorted(_DTYPES)}, got {param_bytes}")
    stages = model.stage_models(pp)
    if dtype is not torch.float32:
        for stage in stages:
            stage.to(dtype)
    return tuple(stages)


@lru_cache(maxsize=64)
def _planned(
    model: PricedModel,
    parallel: JobDims,
    param_bytes: int,
    ranks: frozenset[int] | None,
    muon: bool,
) -> JobPlan:
    """Muon's policy: every parameter's optimizer group is the model's split (AdamW alone is
    priced by reading none of it); nothing else in a recipe changes the FSDP groups, the
    layouts or the optimizer groups."""
    try:
        return plan_job(
            _stage_models(model, parallel.pp, param_bytes),
            parallel,
            model.parallelism(parallel),
            replace(model.policy(), optimizer="muon"),
            ranks=ranks,
            muon=muon,
        )
    except PricingError:
        raise
    except PlanInputError as exc:
        raise PricingError(str(exc)) from None


def priced_ranks(parallel: JobDims) -> frozenset[int]:
    """The ranks every plan the dry run makes is planned on: each pipeline stage's first rank
    (its slots fill the stage's parallel plan). A reader adds the ranks it prices (the dry
    run prices one rank per stage; every other rank of its tensor-parallel coordinate holds
    the same shapes)."""
    size = parallel.world_size // parallel.pp
    return frozenset(k * size for k in range(parallel.pp))


def job_plan(
    model: PricedModel,
    parallel: JobDims,
    *,
    param_bytes: int = 4,
    ranks: frozenset[int] | None = None,
    muon: bool = False,
) -> JobPlan:
    """The :class:`hp_planner.JobPlan` of ``model`` under ``parallel`` (its stage models,
    model parallelism and training policy, with Muon's optimizer split), cached per model and
    degrees: the search prices many layouts, each several times.

    ``param_bytes`` is the storage dtype's size (the meta models are cast to it, so hp-fsdp
    packs in that dtype); ``ranks`` and ``muon`` are :func:`hp_planner.plan_job`'s (plan only
    the FSDP meshes holding those ranks and :func:`priced_ranks`; plan the Muon step or not:
    at scale :mod:`hp_planner.price.muon_traffic` prices it analytically).

    Raises:
        PricingError: degrees the model refuses, or a storage size with no dtype.
    """
    check_fits(model, parallel)
    held = priced_ranks(parallel) if ranks is None else ranks | priced_ranks(parallel)
    return _planned(model, parallel, param_bytes, held, muon)


@dataclass(frozen=True)
class _Structure:
    """The model's trainable parameters and the names of each block's."""

    params: tuple[ParamSpec, ...]
    blocks: tuple[tuple[int, tuple[str, ...]], ...]


def _tp2_plan(model: PricedModel) -> ParallelPlan:
    """The JobPlan's parallel plan of the whole model at ``tp = 2``, over rank 0's meshes.

    The dim a plan shards a parameter on, and the collectives its boundaries run, do not
    depend on the degree: two ranks, the smallest degree at which a style shards, show them.
    """
    parallel = JobDims(tp=2)
    return _planned(model, parallel, 4, priced_ranks(parallel), False).stages[0].parallel


@lru_cache(maxsize=32)
def _structure(model: PricedModel) -> _Structure:
    plan = _tp2_plan(model)
    specs = tuple(
        ParamSpec(p.fqn, p.global_shape, p.optimizer_group, tp_dim_of(p.layout))
        for p in plan.params
        if p.optimizer_group is not None
    )
    blocks: dict[int, list[str]] = {}
    prefix = f"{model.blocks}."
    for spec in specs:
        if spec.name.startswith(prefix):
            blocks.setdefault(int(spec.name[len(prefix) :].split(".")[0]), []).append(spec.name)
    return _Structure(specs, tuple((i, tuple(names)) for i, names in sorted(blocks.items())))


def model_parameters(model: PricedModel) -> tuple[ParamSpec, ...]:
    """Every trainable parameter of ``model``'s stage models (``pp = 1``), in
    ``named_parameters`` order, as its JobPlan resolves it.

    Postconditions: the shapes are those of the real module (built on ``meta``: no memory);
    each parameter is tagged with its optimizer group (``hp_muon.split_params`` with the
    model's policy's AdamW patterns) and the tensor-parallel dim of its resolved plan.
    """
    return _structure(model).params


def parameter_count(model: PricedModel) -> int:
    """Total parameters of the model (from the meta model)."""
    return sum(p.numel for p in model_parameters(model))


# The fits check --------------------------------------------------------------------------------


def check_fits(model: PricedModel, parallel: JobDims) -> None:
    """The model's own check (``PricedModel.check_fits``; a trainer's: the one it runs).

    Raises:
        PricingError: the model cannot be split ``tp`` ways or into ``pp`` stages (the
            model's message).
    """
    model.check_fits(parallel)


def check_tp(model: PricedModel, tp: int) -> None:
    """Refuse a tensor-parallel degree the model refuses (:func:`check_fits`).

    Raises:
        PricingError: ``tp`` does not divide the heads, the KV heads, the dense feed-forward or
            the vocabulary.
    """
    check_fits(model, JobDims(tp=tp))


# Pipeline stages -------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _boundaries(model: PricedModel, pp: int) -> tuple[int, ...]:
    return model.stage_boundaries(pp)


def stage_layers(model: PricedModel, pp: int, stage: int) -> tuple[int, int]:
    """``[start, stop)`` of the blocks pipeline stage ``stage`` of ``pp`` keeps, as the model
    cuts itself (``PricedModel.stage_boundaries``).

    Raises:
        PricingError: fewer blocks than stages.
    """
    check_fits(model, JobDims(pp=pp))
    bounds = _boundaries(model, pp)
    return bounds[stage], bounds[stage + 1]


def rank_stage(
    model: PricedModel, parallel: JobDims, rank: int, *, param_bytes: int = 4
) -> StagePlan:
    """The JobPlan's stage holding ``rank`` (:func:`hp_planner.stage_of`), planned on the
    FSDP meshes holding it.

    Raises:
        PricingError: degrees the model refuses, or a rank outside the world.
    """
    check_fits(model, parallel)
    try:
        stage = stage_of(parallel, rank)
    except ValueError as exc:
        raise PricingError(str(exc)) from None
    plan = job_plan(model, parallel, param_bytes=param_bytes, ranks=frozenset({rank}))
    return plan.stages[stage]


def resolved_plan(model: PricedModel, parallel: JobDims, rank: int = 0) -> ParallelPlan:
    """The tensor-parallel plan the trainer resolves for ``rank``'s model (its pipeline stage
    under ``pp > 1``) over that stage's ``(dp_replicate, dp_shard, tp)`` ranks: the
    JobPlan's (:func:`job_plan`) without its flat slots and optimizer groups.

    Raises:
        PricingError: degrees the model refuses, or a rank outside the world.
    """
    plan = rank_stage(model, parallel, rank).parallel
    bare = tuple(replace(p, flat=None, optimizer_group=None) for p in plan.params)
    return replace(plan, params=bare)


# FSDP groups -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    """One FSDP group (one ``fully_shard`` call) on one tensor-parallel coordinate.

    Attributes:
        name: the module ``fully_shard`` was called on (``"layers.N"`` for a block,
            ``"layers.N.ffn"`` for its experts), ``"root"`` for the root.
        params: its parameters in flat-buffer order.
        local_shapes: each parameter's tensor-parallel local shape (what is packed).
        flat: the packing (``dp_shard`` chunks).
        extra_start: first element of the tail that is all-reduced over ``tail_axis``
            before the reduce-scatter (``flat.padded_numel`` when there is none).
        tail_axis: ``"tp"`` (parameters replicated over tensor parallelism) or, for an
            expert group, ``"ep"`` (the router and shared experts, replicated over ep).
        block: the block the group belongs to (None for the root).
    """

    name: str
    params: tuple[ParamSpec, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    flat: FlatBufferLayout
    extra_start: int
    tail_axis: str = "tp"
    block: int | None = None

    @property
    def is_root(self) -> bool:
        """Whether this is the root's group (kept unsharded from forward to backward)."""
        return self.name == "root"

    @property
    def is_experts(self) -> bool:
        """Whether this is an MoE layer's own group under expert parallelism (sharded over
        the ranks holding the same experts, its tail reduced over ``ep``)."""
        return self.tail_axis == "ep"

    @property
    def owner(self) -> str:
        """The module the group belongs to, as hp-fsdp names it (``""``: the root)."""
        return "" if self.is_root else self.name

    def local_numels(self, coordinate: int) -> tuple[int, ...]:
        """Elements of each parameter in chunk ``coordinate`` (this rank's pieces)."""
        out = [0] * len(self.params)
        for span in self.flat.spans(coordinate):
            out[span.index] += span.stop - span.start
        return tuple(out)


def _group_spec(group: FsdpGroup, experts: frozenset[str], model: PricedModel) -> GroupSpec:
    """A ``fully_shard`` call of the JobPlan as the dry run prices it."""
    if len(group.plans) != 1:
        raise AssertionError(
            f"fully_shard({group.unit!r}) plans {len(group.plans)} storage dtypes; the meta "
            "model has one"
        )
    (plan,) = group.plans
    by_name = {p.name: p for p in model_parameters(model)}
    prefix = f"{group.unit}." if group.unit else ""
    return GroupSpec(
        group.unit or "root",
        tuple(by_name[prefix + fqn] for fqn in plan.fqns),
        plan.shapes,
        plan.flat,
        plan.extra_start,
        "ep" if group.unit in experts else "tp",
        _block_of(group.unit, model.blocks),
    )


def _block_of(unit: str, blocks: str) -> int | None:
    """The block a ``fully_shard`` call's module is in (``"layers.3.ffn"``: 3; the root and
    modules outside the blocks: None)."""
    prefix = f"{blocks}."
    if not unit.startswith(prefix):
        return None
    return int(unit[len(prefix) :].split(".")[0])


def _whole(spec: GroupSpec, plan: GroupPlan) -> GroupSpec:
    """``spec`` kept whole (one chunk), as Megatron's DDP keeps every buffer: hp-fsdp's own
    planner (:func:`hp_fsdp.plan_group`) re-plans the call's parameters, in the JobPlan's
    order with its tail's reduction, on one rank."""
    specs = [
        FSDPParamSpec(
            fqn,
            shape,
            plan.storage_dtype,
            reduction=plan.extra_reduce if slot.offset >= plan.extra_start else (),
        )
        for fqn, shape, slot in zip(plan.fqns, plan.shapes, plan.flat.slots, strict=True)
    ]
    whole = plan_group(specs, Mesh((1,), (_SHARD,)), _SHARD, owner=plan.owner)
    return replace(spec, flat=whole.flat, extra_start=whole.extra_start)


@lru_cache(maxsize=256)
def fsdp_groups(
    model: PricedModel,
    dp_shard: int,
    tp: int,
    *,
    tp_coordinate: int = 0,
    param_bytes: int = 4,
    pp: int = 1,
    stage: int = 0,
    ep: int = 1,
    ep_tp: bool = False,
) -> tuple[GroupSpec, ...]:
    """The FSDP groups of one pipeline stage on one tensor-parallel coordinate, in
    ``fully_shard`` order: the model's JobPlan's (:func:`job_plan`), read, not re-planned.

    The stage is stage ``stage`` of ``pp``, the blocks :func:`stage_layers` gives it (the
    embedding on the first, the head on the last), as the model cuts itself.
    ``dp_shard`` is the number of chunks the dense groups are split into: the runtime's FSDP
    shard axis (``dp_shard x cp`` under context parallelism, which packs as a shard axis of
    that size does), 1 for Megatron's DDP (whole). With ``ep > 1`` every MoE layer's
    feed-forward is a group of its own before its block's (``layers.N.ffn``) over the ranks
    holding the same experts (``dp_shard / ep`` chunks, one when ``dp_shard`` is 1), its tail
    (router, shared experts) all-reduced over ``ep``.

    Postconditions: every trainable parameter of the stage is in exactly one group; each
    group is hp-fsdp's :class:`~hp_fsdp.GroupPlan` of its call (storage dtype of
    ``param_bytes``) on the FSDP mesh holding tensor-parallel coordinate ``tp_coordinate``
    of the stage's first data-parallel rank.

    Raises:
        PricingError: ``tp`` or ``pp`` is a degree the model refuses.
    """
    check_tp(model, tp)
    whole = dp_shard % ep != 0  # Megatron's DDP (one chunk) under expert parallelism
    shards = ep * max(1, dp_shard // ep) if whole else dp_shard
    parallel = JobDims(dp_shard=shards, tp=tp, pp=pp, ep=ep, ep_tp=ep_tp)
    rank = stage * parallel.world_size // pp + tp_coordinate
    job = job_plan(model, parallel, param_bytes=param_bytes, ranks=frozenset({rank}))
    plan = job.stages[stage]
    experts = frozenset(e.module for e in plan.experts)
    moe: dict[str, GroupSpec] = {}
    groups: list[GroupSpec] = []
    for group in plan.fsdp:
        if rank not in group.mesh or not group.plans:
            continue  # a middle pipeline stage's root manages nothing: no group to price
        spec = _group_spec(group, experts, model)
        if group.unit in experts:
            moe[group.unit.rsplit(".", 1)[0]] = spec
            continue
        if whole:
            spec = _whole(spec, group.plans[0])
        # The JobPlan lists the calls in call order (every expert module's first); the dry
        # run prices them in forward order: an MoE layer's group just before its block's.
        groups += [moe.pop(group.unit)] if group.unit in moe else []
        groups.append(spec)
    if moe:
        raise AssertionError(f"expert groups {sorted(moe)} outside every unit of the stage")
    return tuple(groups)


def predicted_layouts(
    model: PricedModel, parallel: JobDims, rank: int, *, param_bytes: int = 4
) -> dict[str, Layout]:
    """Every parameter's layout on ``rank`` once the executors have laid the model out, by
    name: what ``hp_dtensor.contract.layout_of`` reports for the parameters of ``rank``'s
    model (its pipeline stage) after the executors ran the JobPlan: the JobPlan's
    (``StagePlan.layouts``), hp-fsdp's flat slot of each parameter as a RaggedShard on the
    FSDP shard axis, over its tensor- or expert-parallel layout. ``param_bytes`` is the
    storage dtype's size (the trainer's fp32 parameters: 4).

    Raises:
        PricingError: degrees the model refuses, or a rank outside the world.
    """
    return rank_stage(model, parallel, rank, param_bytes=param_bytes).layouts(rank)


def planned_model(
    model: PricedModel, parallel: JobDims, rank: int = 0, *, param_bytes: int = 4
) -> ParallelPlan:
    """The JobPlan's parallel plan of ``rank``'s stage with each parameter's FSDP flat slot on
    ``rank`` (as hp-fsdp records it) and its optimizer group (``"muon"``/``"adamw"`` by
    :func:`hp_muon.split_params`): the table ``hp-dryrun --print-plan`` prints.

    Raises:
        PricingError: degrees the model refuses, or a rank outside the world.
    """
    stage = rank_stage(model, parallel, rank, param_bytes=param_bytes)
    return stage.parallel.with_flat_slots(stage.flat_slots(rank))


# Tensor-parallel activations -------------------------------------------------------------------


@lru_cache(maxsize=32)
def _unit_collectives(model: PricedModel) -> Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    plan = _tp2_plan(model)
    blocks = {f"{model.blocks}.{i}" for i, _ in _structure(model).blocks}
    units = blocks | {model.embedding, model.head}
    output = plan.model_output()
    out: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for b in plan.boundaries:
        unit = b.module
        while unit not in units and "." in unit:
            unit = unit.rsplit(".", 1)[0]
        forward, backward = out.get(unit, ((), ()))
        # The model's gathered output: its backward slices the whole loss gradient.
        sliced = b.module == output and b.gathers_output
        out[unit] = (forward + b.forward, backward + (() if sliced else b.backward))
    return out


def tp_collectives(model: PricedModel, unit: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensor-parallel collectives the module boundaries of ``unit`` (a block,
    ``"layers.N"``, the embedding or the head, by the model's names) run per forward and per
    backward of one microbatch, from the model's resolved plan (``ParallelPlan.boundaries``): a
    dense block's ``("all_reduce", "all_reduce")`` both ways (``o_proj`` and ``ffn.w2``), an MoE
    block's one (its feed-forward is whole), the head's ``("all_gather",)`` forward and nothing
    backward (the model's gathered output is sliced in backward)."""
    return _unit_collectives(model).get(unit, ((), ()))
