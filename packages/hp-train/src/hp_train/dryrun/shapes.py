"""The parameters a run shards, from the model built on ``meta``: shapes, tensor-parallel
placement, optimizer, the FSDP groups as flat-buffer layouts, and every parameter's layout.

Nothing is allocated: :func:`model_parameters` builds :class:`hp_train.model.llama.Transformer`
under
``torch.device("meta")`` (shapes only) and splits the parameters between Muon and AdamW with
:func:`hp_muon.split_params` with the trainer's router patterns (the rule the training loop uses,
:data:`hp_train.optim.ROUTER_PATTERNS`: MoE routers on AdamW).

Tensor parallelism is what the trainer applies: the plan
:func:`hp_train.parallel.parallelize.resolve_tp_plan` resolves (``hp_dtensor.parallel.resolve`` of
:func:`hp_train.parallel.parallelize.tp_plan` on the meta model), read, not restated: a parameter's
tensor-parallel dim is the dim of its ``Shard`` placement on the ``tp`` axis of its resolved
layout. Today that is Megatron's plan on the dense parts (the embedding by vocabulary, the
attention and dense feed-forward projections column- then row-wise, the head by vocabulary);
MoE feed-forwards (router, routed and shared experts) stay whole and replicated on every
tensor-parallel rank, as the trainer keeps them. The one fits check is the trainer's,
:func:`hp_train.parallel.parallelize.check_model_fits`.

FSDP follows ``hp_fsdp``: one ``fully_shard`` per block (``model.layers``' modules), then the
root with the remaining parameters (``tok_embeddings``, ``norm``, ``output``); under expert
parallelism each MoE layer's feed-forward first, a group of its own over the ranks holding the
same experts (:func:`hp_train.parallel.expert.shard_experts`). Each group packs
its parameters' local (tensor-parallel) shapes with :func:`hp_layout.plan_flat_buffer` into
``dp_shard`` chunks, aligned to 16 bytes of the storage dtype, parameters whose gradient the
plan reduces over the tensor-parallel axis (those replicated over a ``tp`` of size > 1) last
(their gradients need an extra all-reduce of the buffer's tail). Pipeline stages keep the
blocks :func:`hp_train.parallel.pipeline.stage_boundaries` gives them, as the trainer cuts the
model.

:func:`predicted_layouts` gives the ``hp_layout.Layout`` of every parameter on one rank, which
is what ``hp_dtensor.contract.layout_of`` reports for the real parameter once
``hp_train.parallel.parallelize.parallelize`` has laid the model out: hp-fsdp's own pure planner
(:func:`hp_fsdp.plan_group`) run on the resolved plan's local shapes, layouts and gradient
reductions (the RaggedShard of a flat slot on ``dp_shard``, over the tensor-parallel layout
with ``tp > 1``), checked against :func:`fsdp_groups`' buffers; :func:`planned_model` is the
resolved plan with those flat slots (what ``hp-dryrun --print-plan`` prints).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

from hp_dtensor.contract import FlatSlot
from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import GroupPlan, plan_group
from hp_fsdp import ParamSpec as FSDPParamSpec
from hp_fsdp.group_plan import ALIGN_BYTES
from hp_layout import FlatBufferLayout, Layout, Mesh, Shard, chunk_length, plan_flat_buffer
from hp_muon import split_params
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig
from hp_train.dryrun.presets import DryRunError
from hp_train.model.llama import Transformer
from hp_train.optim import ROUTER_PATTERNS
from hp_train.parallel.parallelize import AXES, check_model_fits, resolve_tp_plan
from hp_train.parallel.pipeline import keep_stage, stage_boundaries

__all__ = [
    "GroupSpec",
    "ParamSpec",
    "check_fits",
    "check_tp",
    "fsdp_groups",
    "job_mesh",
    "model_parameters",
    "parameter_count",
    "planned_model",
    "predicted_layouts",
    "resolved_plan",
    "stage_layers",
    "tp_collectives",
    "tp_dim_of",
]

_DTYPES = {2: "bfloat16", 4: "float32", 8: "float64"}
_TP = "tp"
_SHARD = "dp_shard"
_REPLICATE = "dp_replicate"


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


# The model on meta -----------------------------------------------------------------------------


def _meta_model(model: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(model)


@dataclass(frozen=True)
class _Structure:
    """The meta model's parameters, by FSDP unit (from the module tree, not names)."""

    params: tuple[ParamSpec, ...]
    blocks: tuple[tuple[int, tuple[str, ...]], ...]
    embedding: tuple[str, ...]
    head: tuple[str, ...]


@lru_cache(maxsize=32)
def _tp_layouts(model: ModelConfig, tp: int) -> Mapping[str, Layout]:
    """Every parameter's layout under the trainer's plan over a ``tp``-rank axis alone."""
    plan = resolve_tp_plan(_meta_model(model), Mesh((1, 1, tp), AXES))
    return {p.fqn: p.layout for p in plan.params}


@lru_cache(maxsize=32)
def _structure(model: ModelConfig) -> _Structure:
    module = _meta_model(model)
    split = split_params(module, adamw_patterns=ROUTER_PATTERNS)
    muon = {name for name, _ in split.muon}
    # The dim a plan shards a parameter on does not depend on the degree: two ranks, the
    # smallest degree at which a style shards, show it.
    layouts = _tp_layouts(model, 2)
    specs = tuple(
        ParamSpec(
            name, tuple(p.shape), "muon" if name in muon else "adamw", tp_dim_of(layouts[name])
        )
        for name, p in module.named_parameters()
        if p.requires_grad
    )
    trainable = {s.name for s in specs}

    def names(prefix: str, sub: torch.nn.Module | None) -> tuple[str, ...]:
        if sub is None:
            return ()
        return tuple(
            f"{prefix}.{n}" for n, p in sub.named_parameters() if f"{prefix}.{n}" in trainable
        )

    blocks = tuple(
        (int(key), names(f"layers.{key}", block)) for key, block in module.layers.items()
    )
    in_blocks = {n for _, ns in blocks for n in ns}
    embedding = names("tok_embeddings", module.tok_embeddings)
    head = tuple(s.name for s in specs if s.name not in in_blocks and s.name not in embedding)
    return _Structure(specs, blocks, embedding, head)


def model_parameters(model: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every trainable parameter of :class:`~hp_train.model.llama.Transformer` built from ``model``,
    in ``named_parameters`` order.

    Postconditions: the shapes are those of the real module (built on ``meta``: no memory);
    each parameter is tagged with its optimizer and the tensor-parallel dim of the trainer's
    resolved plan.
    """
    return _structure(model).params


def parameter_count(model: ModelConfig) -> int:
    """Total parameters of the model (from the meta model)."""
    return sum(p.numel for p in model_parameters(model))


# The fits check --------------------------------------------------------------------------------


def check_fits(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The trainer's check (:func:`hp_train.parallel.parallelize.check_model_fits`), as a dry-run
    error.

    Raises:
        DryRunError: the model cannot be split ``tp`` ways or into ``pp`` stages (the
            trainer's message).
    """
    try:
        check_model_fits(model, parallel)
    except DryRunError:
        raise
    except ConfigError as exc:
        raise DryRunError(str(exc)) from None


def check_tp(model: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the trainer refuses (:func:`check_fits`).

    Raises:
        DryRunError: ``tp`` does not divide the heads, the KV heads, the dense feed-forward or
            the vocabulary.
    """
    check_fits(model, ParallelConfig(tp=tp))


# Pipeline stages -------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _boundaries(model: ModelConfig, pp: int) -> tuple[int, ...]:
    return stage_boundaries(model, pp)


def stage_layers(model: ModelConfig, pp: int, stage: int) -> tuple[int, int]:
    """``[start, stop)`` of the blocks pipeline stage ``stage`` of ``pp`` keeps, as the trainer
    cuts the model (:func:`hp_train.parallel.pipeline.stage_boundaries`: balanced by parameters).

    Raises:
        DryRunError: fewer blocks than stages.
    """
    check_fits(model, ParallelConfig(pp=pp))
    bounds = _boundaries(model, pp)
    return bounds[stage], bounds[stage + 1]


def job_mesh(parallel: ParallelConfig) -> Mesh:
    """The job's rank grid as the trainer builds it
    (:func:`hp_train.parallel.parallelize.build_layout`): ``(dp_replicate, dp_shard, tp)``, with a
    ``pp`` axis in front when pipelining."""
    shape = (parallel.dp_replicate, parallel.dp_shard, parallel.tp)
    if parallel.pp > 1:
        return Mesh((parallel.pp, *shape), ("pp", *AXES))
    return Mesh(shape, AXES)


def _stage_of(parallel: ParallelConfig, rank: int) -> tuple[int, Mesh]:
    """``rank``'s pipeline stage and that stage's ``(dp_replicate, dp_shard, tp)`` mesh."""
    grid = job_mesh(parallel)
    if not 0 <= rank < grid.size:
        raise DryRunError(f"rank {rank} is outside the world of {grid.size} ranks")
    if parallel.pp == 1:
        return 0, grid
    return grid.coordinate(rank)[0], grid.submesh(list(AXES), rank)


@lru_cache(maxsize=64)
def _stage_plan(model: ModelConfig, parallel: ParallelConfig, stage: int) -> ParallelPlan:
    module = _meta_model(model)
    if parallel.pp > 1:
        keep_stage(module, stage, _boundaries(model, parallel.pp))
    grid = job_mesh(parallel)
    if parallel.pp == 1:
        return resolve_tp_plan(module, grid)
    first = grid.rank_at((stage, 0, 0, 0))
    return resolve_tp_plan(module, grid.submesh(list(AXES), first))


def resolved_plan(model: ModelConfig, parallel: ParallelConfig, rank: int = 0) -> ParallelPlan:
    """The tensor-parallel plan the trainer resolves for ``rank``'s model (its pipeline stage
    under ``pp > 1``) over that stage's ``(dp_replicate, dp_shard, tp)`` ranks
    (:func:`hp_train.parallel.parallelize.resolve_tp_plan` on the meta model; no flat slots).

    Raises:
        DryRunError: a configuration the trainer refuses, or a rank outside the world.
    """
    check_fits(model, parallel)
    stage, _ = _stage_of(parallel, rank)
    return _stage_plan(model, parallel, stage)


# FSDP groups -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpec:
    """One FSDP group (one ``fully_shard`` call) on one tensor-parallel coordinate.

    Attributes:
        name: ``"layers.N"`` for a block, ``"root"`` for the root.
        params: its parameters in flat-buffer order.
        local_shapes: each parameter's tensor-parallel local shape (what is packed).
        flat: the packing (``dp_shard`` chunks).
        extra_start: first element of the tail that is all-reduced over ``tail_axis``
            before the reduce-scatter (``flat.padded_numel`` when there is none).
        tail_axis: ``"tp"`` (parameters replicated over tensor parallelism) or, for an
            expert group, ``"ep"`` (the router and shared experts, replicated over ep).
    """

    name: str
    params: tuple[ParamSpec, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    flat: FlatBufferLayout
    extra_start: int
    tail_axis: str = "tp"

    @property
    def is_root(self) -> bool:
        """Whether this is the root's group (kept unsharded from forward to backward)."""
        return self.name == "root"

    @property
    def is_experts(self) -> bool:
        """Whether this is an MoE layer's own group under expert parallelism
        (``layers.N.ffn``: sharded over the ranks holding the same experts)."""
        return self.name.endswith(".ffn")

    @property
    def block(self) -> int | None:
        """The block the group belongs to (None for the root)."""
        return None if self.is_root else int(self.name.split(".")[1])

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


@lru_cache(maxsize=4096)
def _plan(shapes: tuple[tuple[int, ...], ...], shards: int, align: int) -> FlatBufferLayout:
    return plan_flat_buffer(shapes, shards, align)


def _group(
    model: ModelConfig,
    name: str,
    params: list[ParamSpec],
    dp_shard: int,
    tp: int,
    coordinate: int,
    param_bytes: int,
) -> GroupSpec:
    if tp > 1:
        # The plan reduces a gradient over ``tp`` exactly where the parameter is replicated
        # over it; hp-fsdp packs those last.
        layouts = _tp_layouts(model, tp)
        plain = [p for p in params if tp_dim_of(layouts[p.name]) is not None]
        extra = [p for p in params if tp_dim_of(layouts[p.name]) is None]
        params = plain + extra
        shapes = tuple(layouts[p.name].local_shape(coordinate) for p in params)
    else:
        extra = []
        shapes = tuple(p.shape for p in params)
    align = max(1, ALIGN_BYTES // param_bytes)  # hp-fsdp's alignment
    flat = _plan(shapes, dp_shard, align)
    start = flat.slots[len(params) - len(extra)].offset if extra else flat.padded_numel
    return GroupSpec(name, tuple(params), shapes, flat, start)


# How ExpertTensorParallel splits an expert stack's hidden dim over tp.
_EXPERT_TP_DIM = {"w1": 1, "w3": 1, "w2": 2}


def _expert_group(
    name: str,
    params: list[ParamSpec],
    shards: int,
    ep: int,
    tp: int,
    ep_tp: bool,
    param_bytes: int,
) -> GroupSpec:
    """One MoE layer's group under expert parallelism (see :func:`fsdp_groups`)."""
    experts = [p for p in params if ".experts." in p.name]
    extra = [p for p in params if p not in experts]
    shapes = []
    for p in experts:
        dims = list(p.shape)
        dims[0] //= ep
        if ep_tp and tp > 1:
            split = _EXPERT_TP_DIM[p.name.rsplit(".", 1)[1]]
            dims[split] //= tp
        shapes.append(tuple(dims))
    shapes += [p.shape for p in extra]
    ordered = experts + extra
    flat = _plan(tuple(shapes), shards, max(1, ALIGN_BYTES // param_bytes))
    start = flat.slots[len(experts)].offset if extra else flat.padded_numel
    return GroupSpec(name, tuple(ordered), tuple(shapes), flat, start, tail_axis="ep")


@lru_cache(maxsize=256)
def fsdp_groups(
    model: ModelConfig,
    dp_shard: int,
    tp: int,
    *,
    tp_coordinate: int = 0,
    param_bytes: int = 4,
    layers: tuple[int, int] | None = None,
    embedding: bool = True,
    head: bool = True,
    ep: int = 1,
    ep_tp: bool = False,
) -> tuple[GroupSpec, ...]:
    """The FSDP groups in ``fully_shard`` order: one per block of ``layers`` (``[start, stop)``, all
    by default), then the root with ``tok_embeddings`` (if ``embedding``) and ``norm`` and
    ``output`` (if ``head``), as one pipeline stage holds them.

    ``dp_shard`` is the number of chunks the dense groups are split into (the runtime's FSDP
    shard axis: ``dp_shard x cp`` under context parallelism). With ``ep > 1`` every MoE
    layer's feed-forward is a group of its own before its block's (``layers.N.ffn``, as
    :func:`hp_train.parallel.expert.shard_experts` makes it): its experts' local stacks
    (``n_experts / ep`` each; with ``ep_tp`` their hidden dim split over ``tp`` too) first,
    then the router and shared experts, replicated over ep (the tail FSDP all-reduces over
    ``ep``), in ``dp_shard / ep`` chunks (the ranks holding the same experts; one when
    ``dp_shard`` is 1, a run without sharding).

    Postconditions: every listed parameter is in exactly one group; each group's ``flat`` is
    ``hp_layout.plan_flat_buffer`` of its local shapes (those of the resolved plan on
    ``tp_coordinate``) over ``dp_shard`` chunks with hp_fsdp's alignment (16 bytes of
    ``param_bytes``); a root with no parameters is omitted.

    Raises:
        DryRunError: ``tp`` is a degree the trainer refuses.
    """
    check_tp(model, tp)
    structure = _structure(model)
    by_name = {p.name: p for p in structure.params}
    start, stop = layers if layers is not None else (0, model.n_layers)
    blocks = dict(structure.blocks)
    groups: list[GroupSpec] = []
    for i in range(start, stop):
        params = [by_name[n] for n in blocks[i]]
        if ep > 1 and model.moe is not None and model.moe.is_moe_layer(i):
            moe = [p for p in params if p.name.startswith(f"layers.{i}.ffn.")]
            params = [p for p in params if p not in moe]
            groups.append(
                _expert_group(
                    f"layers.{i}.ffn", moe, max(1, dp_shard // ep), ep, tp, ep_tp, param_bytes
                )
            )
        groups.append(
            _group(model, f"layers.{i}", params, dp_shard, tp, tp_coordinate, param_bytes)
        )
    root_names = (structure.embedding if embedding else ()) + (structure.head if head else ())
    root = [p for p in structure.params if p.name in set(root_names)]
    if root:
        groups.append(_group(model, "root", root, dp_shard, tp, tp_coordinate, param_bytes))
    return tuple(groups)


def _rank_groups(
    model: ModelConfig, parallel: ParallelConfig, rank: int, param_bytes: int
) -> tuple[int, Mesh, tuple[GroupSpec, ...]]:
    check_fits(model, parallel)
    stage, stage_mesh = _stage_of(parallel, rank)
    coordinate = dict(zip(stage_mesh.axis_names, stage_mesh.coordinate(rank), strict=True))
    groups = fsdp_groups(
        model,
        parallel.dp_shard,
        parallel.tp,
        tp_coordinate=coordinate[_TP],
        param_bytes=param_bytes,
        layers=stage_layers(model, parallel.pp, stage),
        embedding=stage == 0,
        head=stage == parallel.pp - 1,
    )
    return stage, stage_mesh, groups


def _dp_axes(parallel: ParallelConfig) -> list[str]:
    """The FSDP mesh's axes (:func:`hp_train.parallel.parallelize.build_layout`): HSDP over both
    data
    axes, or 1-d over the shard axis."""
    return [_REPLICATE, _SHARD] if parallel.dp_replicate > 1 else [_SHARD]


def _group_plans(
    model: ModelConfig, parallel: ParallelConfig, rank: int, param_bytes: int
) -> tuple[int, tuple[GroupPlan, ...]]:
    """``rank``'s stage and hp-fsdp's plan of each of its ``fully_shard`` groups
    (:func:`hp_fsdp.plan_group` of the resolved plan's local shapes, layouts and gradient
    reductions, in module order, on the FSDP mesh holding ``rank``), each checked against
    :func:`fsdp_groups` (the buffers the memory and communication figures count)."""
    stage, stage_mesh, groups = _rank_groups(model, parallel, rank, param_bytes)
    plan = _stage_plan(model, parallel, stage) if parallel.tp > 1 else None
    dp_mesh = stage_mesh.submesh(_dp_axes(parallel), rank)
    replicate = _REPLICATE if parallel.dp_replicate > 1 else None
    structure = _structure(model)
    by_name = {p.name: p for p in structure.params}
    members = {f"layers.{i}": names for i, names in structure.blocks}
    members["root"] = structure.embedding + structure.head
    dtype = _DTYPES.get(param_bytes)
    if dtype is None:
        raise DryRunError(f"param_bytes must be one of {sorted(_DTYPES)}, got {param_bytes}")
    plans = []
    for g in groups:
        held = {p.name for p in g.params}
        specs = []
        for name in (n for n in members[g.name] if n in held):
            if plan is None:
                specs.append(FSDPParamSpec(name, by_name[name].shape, dtype))
                continue
            planned = plan.param(name)
            axes = planned.reduction.axes if planned.reduction is not None else ()
            local = planned.layout.local_shape(rank)
            specs.append(FSDPParamSpec(name, local, dtype, planned.layout, axes))
        fsdp = plan_group(specs, dp_mesh, _SHARD, replicate, owner=g.owner)
        if fsdp.fqns != tuple(p.name for p in g.params) or fsdp.flat != g.flat:
            raise AssertionError(
                f"{g.name} on rank {rank}: hp-fsdp packs {fsdp.fqns} as {fsdp.flat}, the dry "
                f"run's figures {[p.name for p in g.params]} as {g.flat}"
            )
        plans.append(fsdp)
    return stage, tuple(plans)


def predicted_layouts(
    model: ModelConfig, parallel: ParallelConfig, rank: int, *, param_bytes: int = 4
) -> dict[str, Layout]:
    """Every parameter's layout on ``rank`` once the trainer has laid the model out, by name:
    what ``hp_dtensor.contract.layout_of`` reports for the parameters of ``rank``'s model (its
    pipeline stage) after :func:`hp_train.parallel.parallelize.parallelize`.

    Each is its flat slot's RaggedShard on ``dp_shard`` as hp-fsdp plans it
    (:func:`hp_fsdp.plan_group`): with ``tp > 1`` over its resolved tensor-parallel layout on
    the stage's ``(dp_replicate, dp_shard, tp)`` mesh; with ``tp == 1`` (no plan applied) over
    the FSDP mesh alone, the ``dp_shard`` (or ``(dp_replicate, dp_shard)``) ranks holding
    ``rank``. ``param_bytes`` is the storage dtype's size (the trainer's fp32 parameters: 4).

    Raises:
        DryRunError: a configuration the trainer refuses, or a rank outside the world.
    """
    _, plans = _group_plans(model, parallel, rank, param_bytes)
    return {fqn: lay for g in plans for fqn, lay in zip(g.fqns, g.layouts, strict=True)}


def planned_model(
    model: ModelConfig, parallel: ParallelConfig, rank: int = 0, *, param_bytes: int = 4
) -> ParallelPlan:
    """:func:`resolved_plan` of ``rank``'s model with each parameter's FSDP flat slot (on
    ``rank``'s tensor-parallel coordinate, as hp-fsdp records it) and its optimizer group
    (``"muon"``/``"adamw"`` by :func:`hp_muon.split_params`): the table
    ``hp-dryrun --print-plan`` prints.

    Raises:
        DryRunError: a configuration the trainer refuses, or a rank outside the world.
    """
    stage, plans = _group_plans(model, parallel, rank, param_bytes)
    slots: dict[str, FlatSlot] = {}
    for g in plans:
        slots.update(g.flat_slots())
    optimizers = {p.name: p.optimizer for p in model_parameters(model) if p.name in slots}
    plan = _stage_plan(model, parallel, stage)
    return plan.with_flat_slots(slots).with_optimizer_groups(optimizers)


# Tensor-parallel activations -------------------------------------------------------------------


@lru_cache(maxsize=32)
def _unit_collectives(model: ModelConfig) -> Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    plan = _stage_plan(model, ParallelConfig(tp=2), 0)
    units = {f"layers.{i}" for i, _ in _structure(model).blocks} | {"tok_embeddings", "output"}
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


def tp_collectives(model: ModelConfig, unit: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensor-parallel collectives the module boundaries of ``unit`` (``"layers.N"``,
    ``"tok_embeddings"`` or ``"output"``) run per forward and per backward of one microbatch,
    from the trainer's resolved plan (``ParallelPlan.boundaries``): a dense block's
    ``("all_reduce", "all_reduce")`` both ways (``o_proj`` and ``ffn.w2``), an MoE block's one
    (its feed-forward is whole), the head's ``("all_gather",)`` forward and nothing backward
    (the model's gathered output is sliced in backward)."""
    return _unit_collectives(model).get(unit, ((), ()))
