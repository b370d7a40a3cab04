"""The job's models on this rank: the policy in the training layout, the rollout engine's copy
(and the frozen reference) in the rollout layout.

* The policy is hp-train's :class:`~hp_train.model.llama.Transformer` laid out by hp-train's
  own :func:`~hp_train.parallel.parallelize.parallelize` (TP, then FSDP over the data-parallel
  axes, flat or per-parameter), over the training grid of :class:`~hp_rl.roles.JobRoles`.
* A rollout model is the same architecture with Megatron's tensor-parallel plan over one
  rollout replica's ranks (``rollout`` x ``tp`` grid, replicated across replicas), no FSDP, no
  gradients: its weights arrive by the weight sync.

Process groups are created collectively: :func:`create_groups` makes every group either layout
can use, on every rank of the job, before any rank builds a model (a disaggregated job's
training ranks never take part in a rollout collective, but must create its groups).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.device_mesh import ensure_groups
from hp_dtensor.interop import annotate_layout, layout_of
from hp_dtensor.parallel import parallelize_module
from hp_layout import Layout, Mesh, Replicate
from hp_rl.roles import JobRoles
from hp_train.config.schema import ModelConfig, TrainConfig
from hp_train.model.llama import Transformer
from hp_train.parallel.parallelize import Layout3D, parallelize, tp_plan

__all__ = [
    "build_policy",
    "build_rollout_model",
    "create_groups",
    "local_layouts",
]


def _axis_sets(mesh: Mesh) -> list[tuple[str, ...]]:
    names = mesh.axis_names
    return [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]


def create_groups(roles: JobRoles, device_type: str = "cpu") -> None:
    """Create, on every rank of the job (collective, same order everywhere), the process
    groups of every set of axes of the training grid and of the rollout grid, and the torch
    device meshes of both grids (which FSDP's state dict and torch's DTensors use).

    torch creates a group collectively over the whole job; a group created later by the
    ranks of one role only (a disaggregated job's training ranks converting their mesh for a
    state dict) would leave the other ranks' group count behind, and the next group the job
    creates together would pair mismatched names and hang."""
    for grid in (roles.training_grid(), roles.rollout_grid()):
        for axes in _axis_sets(grid):
            ensure_groups(grid.groups(list(axes)), "x".join(axes))
        DeviceMesh(device_type, grid).to_torch()


def _training_layout(roles: JobRoles, rank: int, device_type: str) -> Layout3D:
    mesh = DeviceMesh(device_type, roles.training_grid())
    return Layout3D(
        mesh,
        mesh[["dp_replicate", "dp_shard"]],
        roles.training_dp_rank(rank),
        roles.dp,
        roles.tp,
    )


def build_policy(
    model_config: ModelConfig,
    roles: JobRoles,
    rank: int,
    *,
    train: TrainConfig,
    device: torch.device,
    param_layout: str = "flat",
) -> Transformer:
    """The policy on a training rank: initialized from ``train.seed`` (the same numbers as on
    one device), then laid out by hp-train (``param_layout``: FSDP's ``"flat"`` or
    ``"per_param"`` storage)."""
    torch.manual_seed(train.seed)
    with device:
        model = Transformer(model_config)
    layout = _training_layout(roles, rank, device.type)
    options: dict[str, Any] = {} if param_layout == "flat" else {"param_layout": param_layout}
    parallelize(model, layout, config=train, **options)
    return model


def build_rollout_model(
    model_config: ModelConfig, roles: JobRoles, *, device: torch.device
) -> Transformer:
    """A model in the rollout layout on a rollout rank, in eval mode, without gradients (its
    values are placeholders until the first sync)."""
    with device:
        model = Transformer(model_config)
    model.eval()
    model.requires_grad_(False)
    grid = roles.rollout_grid()
    if roles.rollout_tp > 1:
        mesh = DeviceMesh(device.type, grid)
        parallelize_module(
            model,
            mesh,
            tp_plan(model_config, model),
            mode="production",
            tp_axis="tp",
            dp_axes=("rollout",),
        )
    else:
        for p in model.parameters():
            annotate_layout(p, Layout(tuple(p.shape), grid, [Replicate(), Replicate()]))
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    out: torch.Tensor = to_local() if callable(to_local) else t
    return out


def local_layouts(model: nn.Module) -> dict[str, tuple[Layout, torch.Tensor]]:
    """Every parameter of a laid-out model: its global layout (training's, or the rollout
    grid's) and this rank's local tensor (the one the optimizer updates in place, or the one
    the engine computes with)."""
    return {n: (layout_of(p), _local(p).detach()) for n, p in model.named_parameters()}
