"""Lay a :class:`~hp_train.model.Transformer` out over the ranks: TP, then FSDP.

The rank grid is ``(dp_replicate, dp_shard, tp)``, ``tp`` innermost (neighbouring ranks, the
fastest links); with pipeline parallelism a ``pp`` axis goes in front (stages on the slowest
links: one activation per microbatch crosses them) and each stage's ranks form that grid.
Tensor parallelism follows Megatron's plan (``hp_dtensor.parallel.transformer_tp_plan``) on
the dense parts (q/k/v biases are split with their heads, per-head q/k norms and an output
bias are replicated; with tied embeddings the head multiplies by the embedding's local rows
of the vocabulary and its logits are gathered, :class:`TiedHeadParallel`); MoE experts stay
whole on every tensor-parallel rank (expert parallelism is hp-dtensor's, not yet here). FSDP
(``hp_fsdp.fully_shard``) then shards every block and the root over the data-parallel axes:
1-d over ``dp_shard``, HSDP over ``(dp_replicate, dp_shard)``. FSDP is applied even to one
data-parallel rank, so checkpoints and gradient norms take one path at every size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import (
    ColwiseParallel,
    ParallelPlan,
    ParallelStyle,
    ShardingPlan,
    parallelize_module,
    resolve,
    transformer_tp_plan,
)
from hp_dtensor.parallel.plan import Boundary, PlanError
from hp_fsdp import fully_shard
from hp_layout import Mesh, Placement, Replicate, Shard
from hp_train.config import ConfigError, ModelConfig, ParallelConfig
from hp_train.model import TiedHead, Transformer

__all__ = [
    "Layout3D",
    "TiedHeadParallel",
    "build_layout",
    "check_model_fits",
    "parallelize",
    "resolve_tp_plan",
    "tp_plan",
]

AXES = ("dp_replicate", "dp_shard", "tp")
# The tensor-parallel axis and the data axes, as parallelize() applies the TP plan.
_TP_AXES: dict[str, Any] = {"tp_axis": "tp", "dp_axes": ("dp_replicate", "dp_shard")}


@dataclass(frozen=True)
class Layout3D:
    """This rank's place in the job.

    Attributes:
        mesh: the ``(dp_replicate, dp_shard, tp)`` device mesh.
        dp_mesh: the data-parallel sub-mesh FSDP shards over (1-d or 2-d).
        dp_rank: this rank's index among the data-parallel ranks (which batch slice it takes).
        dp_size: data-parallel ranks.
        tp_size: tensor-parallel ranks.
        pipeline_mesh: with ``pp > 1``, the ``(pp, dp_replicate, dp_shard, tp)`` mesh of the
            job (``mesh`` is then this rank's stage); None without pipelining.
    """

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    tp_size: int
    pipeline_mesh: DeviceMesh | None = None


# Why each size must split evenly ``tp`` ways (the Megatron plan of ``tp_plan``).
_TP_SPLITS = (
    ("n_heads", "tensor parallelism splits attention by whole heads"),
    ("n_kv_heads", "tensor parallelism splits attention by whole heads"),
    ("ffn_dim", "the dense feed-forward's hidden units are split evenly"),
    ("vocab_size", "the embedding and the output head split the vocabulary evenly"),
)


def check_model_fits(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise :class:`ConfigError` when the model cannot be split ``parallel.tp`` ways or into
    ``parallel.pp`` stages (the one check of the trainer and the dry run, ``hp_train.dryrun``).

    Raises:
        ConfigError: ``tp`` does not divide ``n_heads``, ``n_kv_heads``, ``ffn_dim`` or
            ``vocab_size`` (the first that fails is named, with its divisors; ``ffn_dim`` only
            when some block is dense), there are fewer blocks than stages, or tied embeddings
            would be split over pipeline stages.
    """
    tp = parallel.tp
    dense = model.moe is None or any(not model.moe.is_moe_layer(i) for i in range(model.n_layers))
    for name, why in _TP_SPLITS:
        value = getattr(model, name)
        if value % tp and (name != "ffn_dim" or dense):
            divisors = [str(d) for d in range(1, value + 1) if value % d == 0]
            if len(divisors) > 12:
                divisors = [*divisors[:11], "...", str(value)]
            raise ConfigError(
                f"tp={tp} must divide {name}={value} ({why}); choose tp among its divisors "
                f"{', '.join(divisors)}"
            )
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
    """The device meshes for ``parallel`` over the initialized default process group.

    Raises:
        ConfigError: the world size differs from ``parallel.world_size``.
    """
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise ConfigError(
            f"the job has {world} ranks but dp_replicate x dp_shard x tp x pp = "
            f"{parallel.world_size}; launch with torchrun --nproc-per-node {parallel.world_size} "
            "(or change the dimensions)"
        )
    shape = (parallel.dp_replicate, parallel.dp_shard, parallel.tp)
    pipeline_mesh = None
    if parallel.pp > 1:
        pipeline_mesh = DeviceMesh(device_type, Mesh((parallel.pp, *shape), ("pp", *AXES)))
        mesh = pipeline_mesh[list(AXES)]
    else:
        mesh = DeviceMesh(device_type, Mesh(shape, AXES))
    # HSDP over both data axes, or 1-d FSDP over the shard axis.
    dp_axes = ["dp_replicate", "dp_shard"] if parallel.dp_replicate > 1 else ["dp_shard"]
    dp_mesh = mesh[dp_axes]
    coordinate = mesh.mesh.coordinate(dist.get_rank())
    dp_rank = coordinate[0] * parallel.dp_shard + coordinate[1]
    return Layout3D(mesh, dp_mesh, dp_rank, parallel.dp, parallel.tp, pipeline_mesh)


@dataclass(frozen=True)
class TiedHeadParallel(ParallelStyle):
    """The output head of tied embeddings (:class:`~hp_train.model.TiedHead`) under tensor
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
                "supports hp_train.model.TiedHead"
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
        plan["output"] = TiedHeadParallel(head.input_layouts, head.output_layouts)
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


def resolve_tp_plan(
    model: Transformer, mesh: Mesh | DeviceMesh, *, mode: str = "production"
) -> ParallelPlan:
    """The plan :func:`parallelize` applies to ``model`` (the whole model or a pipeline stage,
    not yet parallelized; a ``meta`` model is enough) over its ``(dp_replicate, dp_shard,
    tp)`` ``mesh``: :func:`tp_plan` with ``tp > 1``; with ``tp == 1`` no plan is applied and
    every parameter is replicated (pure: ``hp_dtensor.parallel.resolve``, no process group)."""
    grid = mesh if isinstance(mesh, Mesh) else mesh.mesh
    plan = tp_plan(model.config, model) if grid.axis_size("tp") > 1 else {}
    return resolve(model, grid, plan, mode=mode, **_TP_AXES)


def parallelize(
    model: Transformer, layout: Layout3D, *, mode: str = "production", **fsdp: Any
) -> Transformer:
    """Apply TP (when ``tp > 1``) in ``mode``, then FSDP per block and on the root."""
    if layout.tp_size > 1:
        parallelize_module(
            model,
            layout.mesh,
            tp_plan(model.config, model),
            mode=mode,  # type: ignore[arg-type]
            **_TP_AXES,
        )
    for block in model.layers.values():
        fully_shard(block, mesh=layout.dp_mesh, **fsdp)
    fully_shard(model, mesh=layout.dp_mesh, **fsdp)
    return model
