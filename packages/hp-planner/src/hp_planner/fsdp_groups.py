"""Every ``fully_shard`` call of a stage, planned by hp-fsdp on every FSDP mesh.

The calls are the ones a trainer makes, in order: one per MoE module under expert
parallelism (over the expert FSDP meshes: the ranks holding the same experts), one per unit
(``ModelParallelism.fsdp_units``), then the stage's root, which takes every parameter no
earlier call owns. A parameter's planning inputs are what ``hp_fsdp`` reads from the
parameter once the model is laid out: its tensor-parallel layout and gradient reduction when
a plan was applied (``tp > 1``: the local shape on the mesh's ranks; ``tp == 1``: no plan is
applied and the parameter is whole), its expert-parallel layout for an expert module's
parameters. hp-fsdp packs (:func:`hp_fsdp.plan_group`); nothing here restates its rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import GroupPlan, ParamSpec, plan_group
from hp_fsdp.group_plan import dtype_name, torch_dtype
from hp_layout import Mesh
from hp_planner.inputs import TrainingPolicy
from hp_planner.job import ExpertPlan, FsdpGroup
from hp_planner.meshes import REPLICATE, StageMeshes

__all__ = ["plan_fsdp_groups"]


def _params_of(model: nn.Module, unit: str, owned: set[str]) -> list[tuple[str, nn.Parameter]]:
    """``unit``'s parameters no earlier call owns, by full name (``named_parameters`` order,
    a tied parameter under its first name)."""
    module = model.get_submodule(unit)
    prefix = f"{unit}." if unit else ""
    return [(prefix + n, p) for n, p in module.named_parameters() if prefix + n not in owned]


def _spec(
    name: str, relative: str, param: nn.Parameter, plan: ParallelPlan | None, rank: int
) -> ParamSpec:
    """What hp-fsdp reads of parameter ``name`` on ``rank`` (module docstring); ``plan``: the
    applied plan holding it under ``relative``, None when none is applied."""
    dtype = dtype_name(param.dtype)
    if plan is None:
        return ParamSpec(relative, tuple(param.shape), dtype)
    planned = plan.param(name)
    axes = planned.reduction.axes if planned.reduction is not None else ()
    layout = planned.layout
    return ParamSpec(relative, layout.local_shape(rank), dtype, layout, axes)


def _group(
    unit: str,
    params: Sequence[tuple[str, nn.Parameter]],
    plan: ParallelPlan | None,
    plan_names: dict[str, str],
    mesh: Mesh,
    shard_axis: str,
    training: TrainingPolicy,
) -> GroupPlan:
    rank = mesh.ranks[0]
    prefix = f"{unit}." if unit else ""
    specs = [
        _spec(plan_names.get(name, name), name[len(prefix) :], p, plan, rank) for name, p in params
    ]
    return plan_group(
        specs,
        mesh,
        shard_axis,
        REPLICATE if REPLICATE in mesh.axis_names and mesh.axis_size(REPLICATE) > 1 else None,
        param_dtype=_dtype(training.param_dtype),
        reduce_dtype=_dtype(training.reduce_dtype),
        owner=unit,
    )


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else torch_dtype(name)


def plan_fsdp_groups(
    model: nn.Module,
    meshes: StageMeshes,
    units: Sequence[str],
    tp: ParallelPlan | None,
    experts: Sequence[ExpertPlan],
    training: TrainingPolicy,
) -> tuple[FsdpGroup, ...]:
    """The stage's ``fully_shard`` calls (module docstring): the expert modules' on every
    expert FSDP mesh, then per FSDP mesh the units' and the root's.

    ``tp`` is the stage's tensor-parallel plan when one is applied (``tp > 1``), else None.

    Postconditions: every parameter of ``model`` is in exactly one call per FSDP mesh of its
    kind; each plan is ``hp_fsdp.plan_group`` of the call's parameters on the mesh's first
    rank.
    """
    groups: list[FsdpGroup] = []
    owned: set[str] = set()
    expert_params: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for expert in experts:
        expert_params[expert.module] = _params_of(model, expert.module, owned)
        owned.update(name for name, _ in expert_params[expert.module])
    for mesh in meshes.expert_fsdp_meshes():
        for expert in experts:
            prefix = f"{expert.module}."
            names = {name: name[len(prefix) :] for name, _ in expert_params[expert.module]}
            plan = _group(
                expert.module,
                expert_params[expert.module],
                expert.plan,
                names,
                mesh,
                "expert_shard",
                training,
            )
            groups.append(FsdpGroup(expert.module, plan))
    calls: list[tuple[str, list[tuple[str, nn.Parameter]]]] = []
    for unit in [*units, ""]:
        params = _params_of(model, unit, owned)
        owned.update(name for name, _ in params)
        if params or unit == "":
            calls.append((unit, params))
    for mesh in meshes.fsdp_meshes():
        for unit, params in calls:
            if not params:
                continue
            plan = _group(unit, params, tp, {}, mesh, meshes.shard_axis, training)
            groups.append(FsdpGroup(unit, plan))
    return tuple(groups)
