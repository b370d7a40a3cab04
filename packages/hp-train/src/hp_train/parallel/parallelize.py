"""Lay a :class:`~hp_train.model.llama.Transformer` out over the ranks: TP, then FSDP.

The rank grid is ``(dp_replicate, dp_shard, tp)``, ``tp`` innermost (neighbouring ranks, the
fastest links); with pipeline parallelism a ``pp`` axis goes in front (stages on the slowest
links: one activation per microbatch crosses them) and each stage's ranks form that grid.
Tensor parallelism follows Megatron's plan (``hp_dtensor.parallel.transformer_tp_plan``) on
the dense parts (q/k/v biases are split with their heads, per-head q/k norms and an output
bias are replicated; with tied embeddings the head multiplies by the embedding's local rows
of the vocabulary and its logits are gathered, :class:`TiedHeadParallel`); MoE experts stay
whole on every tensor-parallel rank unless expert parallel (``hp_train.parallel.expert``). FSDP
(``hp_fsdp.fully_shard``) then shards every block and the root over the data-parallel axes:
1-d over ``dp_shard``, HSDP over ``(dp_replicate, dp_shard)``. FSDP is applied even to one
data-parallel rank, so checkpoints and gradient norms take one path at every size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.interop import style_placement
from hp_dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    ShardingPlan,
    parallelize_module,
    transformer_tp_plan,
)
from hp_dtensor.parallel.plan import Boundary, PlanError
from hp_fsdp import CPUOffloadPolicy, fully_shard
from hp_layout import Mesh, Placement, Replicate, Shard
from hp_planner import JobDims, StageMeshes, StagePlan, stage_meshes, stage_of
from hp_planner.meshes import CP_SHARD, across_stages
from hp_planner.price.model import tp_split_problem
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.model.llama import TiedHead, Transformer
from hp_train.parallel.activations import apply_activation_policy
from hp_train.parallel.compiled import compile_blocks
from hp_train.parallel.context import apply_context_parallel
from hp_train.parallel.expert import apply_expert_parallel, moe_layers, seed_aux_loss_once
from hp_train.parallel.precision import convert_blocks_to_float8, fsdp_precision

__all__ = [
    "Layout3D",
    "TiedHeadParallel",
    "build_layout",
    "check_model_fits",
    "parallelize",
    "tp_plan",
]

# The tensor-parallel axis and the data axes, as parallelize() applies the TP plan.
_TP_AXES: dict[str, Any] = {"tp_axis": "tp", "dp_axes": ("dp_replicate", "dp_shard")}


@dataclass(frozen=True)
class Layout3D:
    """This rank's place in the job.

    Attributes:
        mesh: the ``(dp_replicate, dp_shard, tp)`` device mesh (with ``cp > 1``:
            ``(dp_replicate, dp_shard_cp, tp)``, ``dp_shard x cp`` flattened), the one tensor
            parallelism applies to.
        dp_mesh: the data-parallel sub-mesh FSDP shards over (1-d or 2-d).
        dp_rank: this rank's index among the data-parallel ranks (which batch slice it takes).
        dp_size: data-parallel ranks.
        tp_size: tensor-parallel ranks.
        pipeline_mesh: with ``pp > 1``, the ``(pp, dp_replicate, dp_shard, tp)`` mesh of the
            job (``dp_shard_cp`` with ``cp > 1``; ``mesh`` is then this rank's stage); None
            without pipelining.
        cp_mesh: with ``cp > 1``, the 1-d mesh of this rank's context-parallel group.
        expert_mesh: with ``ep > 1``, the ``(dp_replicate, expert_shard, ep, tp)`` mesh of
            the same ranks as ``mesh`` (the MoE layers' expert parallelism is on its ``ep``
            axis).
        expert_dp_mesh: with ``ep > 1``, the sub-mesh FSDP shards the experts over (the ranks
            holding the same experts: ``expert_shard``, with ``dp_replicate`` under HSDP).
        cp_variant: the context-parallel attention, ``"ring"`` or ``"ulysses"``.
        experts_split_over_tp: each expert's hidden dim is split over ``tp`` as well
            (``--ep-tp``).
    """

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    tp_size: int
    pipeline_mesh: DeviceMesh | None = None
    cp_mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None
    expert_dp_mesh: DeviceMesh | None = None
    cp_variant: str = "ring"
    experts_split_over_tp: bool = False

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (1 without)."""
        return 1 if self.cp_mesh is None else self.cp_mesh.size()

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks (1 without)."""
        return 1 if self.expert_mesh is None else self.expert_mesh.size("ep")


# Why each size must split evenly ``tp`` ways (the Megatron plan of ``tp_plan``).
def check_model_fits(model: ModelConfig, parallel: JobDims) -> None:
    """Raise :class:`ConfigError` when the model cannot be split ``parallel.tp`` ways or into
    ``parallel.pp`` stages (the one check of the trainer and of its pricing,
    ``hp_train.dryrun.TrainerModel``).

    Raises:
        ConfigError: ``tp`` does not divide ``n_heads``, ``n_kv_heads``, ``ffn_dim`` or
            ``vocab_size`` (the first that fails is named, with its divisors; ``ffn_dim`` only
            when some block is dense), there are fewer blocks than stages, or tied embeddings
            would be split over pipeline stages.
    """
    problem = tp_split_problem(model, parallel.tp)  # the planner's rule, for any model
    if problem is not None:
        raise ConfigError(problem)
    if model.tie_embeddings and parallel.pp > 1:
        raise ConfigError(
            f"tie_embeddings with pp={parallel.pp}: the embedding (first stage) and the output "
            "head (last stage) would hold two copies of the one tied weight, which nothing "
            "keeps equal here; use pp=1 for a model with tied embeddings"
        )
    if parallel.pp > model.n_layers:
        raise ConfigError(
            f"pp={parallel.pp} needs at least {parallel.pp} blocks (one per stage), the model "
            f"has n_layers={model.n_layers}"
        )


def build_layout(parallel: ParallelConfig, device_type: str) -> Layout3D:
    """The device meshes of the planner's grids (:func:`hp_planner.job_grid`,
    :func:`hp_planner.stage_meshes`) over the initialized default process group.

    Creating a process group is collective over the job, so each kind of mesh is cut from one
    mesh over the whole job (:func:`hp_planner.meshes.across_stages`: with ``pp > 1`` every
    stage's stage, context and expert meshes stacked along ``pp``), and with ``pp > 1`` every
    rank creates all their groups here, in the same order, before any stage runs alone (a
    group first needed inside a stage's forward would otherwise be created while the other
    stages wait for activations).

    Postconditions: ``mesh``, ``cp_mesh``'s context mesh and ``expert_mesh`` equal this rank's
    stage's planned meshes; ``pipeline_mesh`` (``pp > 1``) is the stacked stage mesh.

    Raises:
        ConfigError: the world size differs from ``parallel.world_size``.
    """
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise ConfigError(
            f"the job has {world} ranks but dp_replicate x dp_shard x cp x tp x pp = "
            f"{parallel.world_size}; launch with torchrun --nproc-per-node {parallel.world_size} "
            "(or change the dimensions)"
        )
    rank = dist.get_rank()
    planned = stage_meshes(parallel, stage_of(parallel, rank))
    stacked = _stacked_meshes(parallel, device_type)
    mesh = stacked["stage"][list(planned.stage.axis_names)]
    pipeline_mesh = stacked["stage"] if parallel.pp > 1 else None
    cp_mesh = None if "context" not in stacked else stacked["context"]["cp"]
    # The data-parallel coordinate is (dp_replicate, dp_shard) of the unflattened grid.
    replica, shard = (planned.context or planned.stage).coordinate(rank)[:2]
    expert_mesh = expert_dp_mesh = None
    if planned.expert is not None:
        expert_mesh = stacked["expert"][list(planned.expert.axis_names)]
        expert_dp_mesh = expert_mesh[list(planned.expert_dp_axes)]
    return Layout3D(
        mesh,
        mesh[list(planned.dp_axes)],
        replica * parallel.dp_shard + shard,
        parallel.dp,
        parallel.tp,
        pipeline_mesh,
        cp_mesh,
        expert_mesh,
        expert_dp_mesh,
        parallel.cp_variant,
        parallel.ep_tp,
    )


def _stacked_meshes(parallel: ParallelConfig, device_type: str) -> dict[str, DeviceMesh]:
    """The job-wide stage, context and expert meshes (those the job has), by kind; with
    ``pp > 1`` with every group along each of their axes created, and the torch meshes of
    those that hold parameters (stage, expert) built (collective).

    A checkpoint converts each parameter's mesh to torch's, which builds the job-wide torch
    mesh it is cut from the first time (``hp_dtensor.DeviceMesh.to_torch``, collective): a
    stage without MoE layers never converts an expert mesh, so the stages holding them would
    wait for it there (measured: the save hangs at pp 2 x ep 2 with the MoE blocks in one
    stage); built here, every rank builds them in the same order.
    """
    parts: dict[str, Callable[[StageMeshes], Mesh | None]] = {
        "stage": lambda m: m.stage,
        "context": lambda m: m.context,
        "expert": lambda m: m.expert,
    }
    out: dict[str, DeviceMesh] = {}
    for kind, part in parts.items():
        whole = across_stages(parallel, part)
        if whole is None:
            continue
        out[kind] = DeviceMesh(device_type, whole)
        if parallel.pp > 1:
            for axis in whole.axis_names:
                out[kind].get_group(axis)
            if kind != "context":  # the context-parallel attention holds no parameter
                out[kind].to_torch()
    return out


@dataclass(frozen=True)
class TiedHeadParallel(ParallelStyle):
    """The output head of tied embeddings (:class:`~hp_train.model.llama.TiedHead`) under tensor
    parallelism: the embedding's weight is split by vocabulary rows (``RowwiseParallel`` on
    the embedding), so the head's local logits are that slice of the vocabulary, the layout
    ``ColwiseParallel`` gives an untied head; its boundaries are the same.

    Attributes:
        input_layouts: how the hidden states arrive (default Replicate).
        output_layouts: how the logits are handed on (default Replicate: gathered).
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if not isinstance(module, TiedHead):
            raise PlanError(
                f"TiedHeadParallel cannot shard module {name!r} ({type(module).__name__}); it "
                "supports hp_train.model.llama.TiedHead"
            )
        return ShardingPlan(
            inputs=(Boundary(self.input_layouts or Replicate(), Replicate()),),
            outputs=Boundary(Shard(-1), self.output_layouts or Replicate()),
            style="TiedHeadParallel",
        )


def tp_plan(model: ModelConfig, stage: Transformer | None = None) -> dict[str, ParallelStyle]:
    """Megatron's plan for the dense parts; MoE blocks keep their feed-forward whole; a tied
    head takes :class:`TiedHeadParallel` with the boundaries of the untied head's entry.
    Given a pipeline ``stage``, only the entries naming modules the stage has."""
    plan = transformer_tp_plan()
    if model.tie_embeddings:
        head = plan["output"]
        assert isinstance(head, ColwiseParallel)
        # A style's fields may hold torch's placements as given; ours are hp's.
        plan["output"] = TiedHeadParallel(
            None if head.input_layouts is None else style_placement(head.input_layouts),
            None if head.output_layouts is None else style_placement(head.output_layouts),
        )
    out = plan
    if model.moe is not None:
        dense_ffn = {k: v for k, v in plan.items() if ".ffn." in k}
        out = {k: v for k, v in plan.items() if ".ffn." not in k}
        for i in range(model.n_layers):
            if not model.moe.is_moe_layer(i):
                for key, style in dense_ffn.items():
                    out[key.replace("layers.*", f"layers.{i}")] = style
    if stage is None:
        return out
    return {k: v for k, v in out.items() if _names_part_of(stage, k)}


def _names_part_of(stage: Transformer, key: str) -> bool:
    head, _, rest = key.partition(".")
    if head != "layers":
        return getattr(stage, head) is not None
    index = rest.partition(".")[0]
    return bool(stage.layers) if index == "*" else index in stage.layers


def _axes_of(grid: Mesh) -> dict[str, Any]:
    """The tensor-parallel and data axes the TP plan is applied with on ``grid`` (with
    ``cp > 1`` the shard axis is ``dp_shard_cp``)."""
    if CP_SHARD not in grid.axis_names:
        return _TP_AXES
    return {"tp_axis": "tp", "dp_axes": ("dp_replicate", CP_SHARD)}


def parallelize(
    model: Transformer,
    layout: Layout3D,
    *,
    mode: str = "production",
    config: TrainConfig | None = None,
    plan: StagePlan | None = None,
    **fsdp: Any,
) -> Transformer:
    """Lay ``model`` out for ``layout`` with ``config``'s techniques, in this order: FP8
    linears, TP (when ``tp > 1``, in ``mode``), context-parallel attention, expert-parallel
    MoE layers, activation checkpointing / swap, ``torch.compile``, then FSDP per block (the
    experts and the MoE's replicated parts in groups of their own) and on the root, with
    ``config``'s precision, offload and the gradient divide factor of its accumulation.
    ``fsdp`` adds ``fully_shard`` arguments. Without ``config``: ``TrainConfig()``'s (none of
    them). With the run's stage ``plan`` (hp-planner's), every ``fully_shard`` call takes its
    planned groups (``plan=``) and refuses to allocate anything else."""
    config = TrainConfig() if config is None else config
    if config.fp8 != "none":
        convert_blocks_to_float8(model, config.fp8)
    if layout.tp_size > 1:
        parallelize_module(
            model,
            layout.mesh,
            tp_plan(model.config, model),
            mode=mode,  # type: ignore[arg-type]
            **_axes_of(layout.mesh.mesh),
        )
    if layout.cp_mesh is not None:
        apply_context_parallel(model, layout.cp_mesh, layout.cp_variant)
    if layout.expert_mesh is not None:
        apply_expert_parallel(
            model, layout.expert_mesh, split_experts_over_tp=layout.experts_split_over_tp
        )
    elif layout.tp_size > 1:
        seed_aux_loss_once(model, layout.mesh)
    blocks = dict(model.layers.items())
    apply_activation_policy(list(blocks.values()), config)
    if config.compile:
        compile_blocks(list(blocks.values()))
    _shard(model, blocks, layout, config, plan, fsdp)
    return model


def _shard(
    model: Transformer,
    blocks: dict[str, nn.Module],
    layout: Layout3D,
    config: TrainConfig,
    plan: StagePlan | None,
    fsdp: dict[str, Any],
) -> None:
    """FSDP on the MoE layers (expert parallelism), every block, then the root."""
    options = {**fsdp_precision(config, replicated=layout.dp_mesh.ndim == 2), **fsdp}
    if config.offload in ("params", "both"):
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=layout.mesh.device_type != "cpu")
    rank = dist.get_rank()

    def planned(unit: str) -> dict[str, Any]:
        return {} if plan is None else {"plan": plan.group_plans(unit, rank)}

    if layout.expert_dp_mesh is not None:
        for index, moe in moe_layers(model).items():
            unit = f"layers.{index}.ffn"
            fully_shard(moe, mesh=layout.expert_dp_mesh, **options, **planned(unit))
    for index, block in blocks.items():
        fully_shard(block, mesh=layout.dp_mesh, **options, **planned(f"layers.{index}"))
    fully_shard(model, mesh=layout.dp_mesh, **options, **planned(""))
    if config.grad_accum > 1:
        divide = layout.dp_mesh.mesh.size * config.grad_accum
        model.set_gradient_divide_factor(float(divide))  # type: ignore[operator]
