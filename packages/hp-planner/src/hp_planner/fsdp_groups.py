"""Every ``fully_shard`` call of a stage, planned by hp-fsdp on every FSDP mesh.

The calls are the ones a trainer makes, in order: one per MoE module under expert
parallelism (over the expert FSDP meshes: the ranks holding the same experts), one per unit
(``ModelParallelism.fsdp_units``), then the stage's root, which takes every parameter no
earlier call owns. Each is :func:`hp_fsdp.plan_fully_shard` of the call on the meta model, the
one planner ``fully_shard`` itself runs (parameter selection, nested units, dtypes, packing):
nothing here restates its rules. What a parameter looks like once laid out comes from the
resolved plans (:func:`hp_fsdp.spec_from_plan`): its tensor-parallel layout and gradient
reduction when a plan is applied (``tp > 1``; with ``tp == 1`` none is and the parameter is
whole), its expert-parallel layout for an expert module's parameters. A large model's blocks
are planned once each by hp-fsdp, which plans each distinct group once per process.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import GroupPlan, MixedPrecisionPolicy, ParamSpec, plan_fully_shard, spec_from_plan
from hp_fsdp.group_plan import torch_dtype
from hp_layout import Mesh
from hp_planner.inputs import TrainingPolicy
from hp_planner.job import ExpertPlan, FsdpGroup
from hp_planner.meshes import StageMeshes

__all__ = ["plan_fsdp_groups"]


def _policy(training: TrainingPolicy) -> MixedPrecisionPolicy | None:
    if training.param_dtype is None and training.reduce_dtype is None:
        return None
    return MixedPrecisionPolicy(
        param_dtype=_dtype(training.param_dtype), reduce_dtype=_dtype(training.reduce_dtype)
    )


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else torch_dtype(name)


def _specs(
    module: nn.Module, plan: ParallelPlan | None, rank: int
) -> dict[nn.Parameter, ParamSpec] | None:
    """How ``module``'s parameters look on ``rank`` once ``plan`` (resolved on ``module``)
    is applied; None when no plan is applied (the parameters are whole)."""
    if plan is None:
        return None
    return {p: spec_from_plan(plan.param(name), rank) for name, p in module.named_parameters()}


def _owned(plans: tuple[GroupPlan, ...], unit: str) -> tuple[GroupPlan, ...]:
    """``plans`` with the owner ``fully_shard`` records once the root is sharded: the unit's
    name in the stage model (``plan_fully_shard`` leaves it empty; ``plan=`` ignores it)."""
    return tuple(plan.with_owner(unit) for plan in plans)


def _calls(
    model: nn.Module,
    mesh: Mesh,
    units: Sequence[str],
    nested: Sequence[str],
    specs: dict[nn.Parameter, ParamSpec] | None,
    training: TrainingPolicy,
) -> list[FsdpGroup]:
    """The units' and the root's calls on one FSDP mesh, in order. A call managing no
    parameter is kept with no plan (a middle pipeline stage's root: ``fully_shard`` is still
    called on it and makes no group, and ``plan=()`` says so)."""
    done = [model.get_submodule(n) for n in nested]
    groups = []
    for unit in [*units, ""]:
        module = model.get_submodule(unit)
        plans = plan_fully_shard(
            module, mesh, mp_policy=_policy(training), nested=done, specs=specs
        )
        done.append(module)
        groups.append(FsdpGroup(unit, mesh, _owned(plans, unit)))
    return groups


def _holding(meshes: Sequence[Mesh], held: Collection[int] | None) -> Sequence[Mesh]:
    """The ``meshes`` holding one of the ``held`` ranks (all of them when None)."""
    if held is None:
        return meshes
    return [mesh for mesh in meshes if any(rank in mesh for rank in held)]


def plan_fsdp_groups(
    model: nn.Module,
    meshes: StageMeshes,
    units: Sequence[str],
    tp: ParallelPlan | None,
    experts: Sequence[ExpertPlan],
    training: TrainingPolicy,
    held: Collection[int] | None = None,
) -> tuple[FsdpGroup, ...]:
    """The stage's ``fully_shard`` calls (module docstring): the expert modules' on every
    expert FSDP mesh, then per FSDP mesh the units' and the root's.

    ``tp`` is the stage's tensor-parallel plan when one is applied (``tp > 1``), else None.
    ``held``: plan only the meshes holding one of these ranks (None: every mesh).

    Postconditions: every parameter of ``model`` is in exactly one call per FSDP mesh of its
    kind; each call's plans are ``hp_fsdp.plan_fully_shard`` of it on that mesh.
    """
    groups: list[FsdpGroup] = []
    policy = _policy(training)
    for mesh in _holding(meshes.expert_fsdp_meshes(), held):
        for expert in experts:
            module = model.get_submodule(expert.module)
            specs = _specs(module, expert.plan, mesh.ranks[0])
            plans = plan_fully_shard(module, mesh, mp_policy=policy, specs=specs)
            groups.append(FsdpGroup(expert.module, mesh, _owned(plans, expert.module)))
    nested = [e.module for e in experts]
    for mesh in _holding(meshes.fsdp_meshes(), held):
        specs = _specs(model, tp, mesh.ranks[0])
        groups += _calls(model, mesh, units, nested, specs, training)
    return tuple(groups)
