"""Where a module's resolved plan and its sharders' flat slots are recorded (re-exported by
:mod:`hp_dtensor.contract`, the public face)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from hp_dtensor.interop import layout_of
from hp_dtensor.parallel.resolved import ParallelPlan, ParamFlatSlot, ParamPlan
from hp_layout import Layout, Mesh, Replicate

__all__ = ["parallel_plan_of", "record_flat_slots", "record_parallel_plan"]

_PLAN = "_hp_dtensor_parallel_plan"
_SLOTS = "_hp_dtensor_flat_slots"


def record_parallel_plan(module: nn.Module, plan: ParallelPlan) -> None:
    """Record the resolved plan ``module`` was parallelized by (the executors do)."""
    object.__setattr__(module, _PLAN, plan)


def record_flat_slots(module: nn.Module, slots: Mapping[str, ParamFlatSlot]) -> None:
    """Record where a sharder keeps ``module``'s parameters (names relative to ``module``)."""
    object.__setattr__(module, _SLOTS, dict(slots))


def parallel_plan_of(module: nn.Module) -> ParallelPlan | None:
    """``module``'s resolved plan with every flat slot recorded on it and its submodules; for
    a module no tensor-parallel plan was applied to but a sharder has planned, a plan whose
    parameters are whole (a one-rank layout) with their slots; None when neither happened."""
    plan: ParallelPlan | None = getattr(module, _PLAN, None)
    slots: dict[str, ParamFlatSlot] = {}
    for prefix, sub in module.named_modules():
        for name, slot in getattr(sub, _SLOTS, {}).items():
            slots[f"{prefix}.{name}" if prefix else name] = slot
    if plan is None and not slots:
        return None
    if plan is None:
        plan = _whole_parameters(module)
    return plan.with_flat_slots(slots) if slots else plan


def _whole_parameters(module: nn.Module) -> ParallelPlan:
    mesh = Mesh((1,), ("replica",))
    params: list[ParamPlan] = []
    seen: dict[int, int] = {}
    for prefix, sub in module.named_modules():
        for attr, p in sub.named_parameters(recurse=False):
            fqn = f"{prefix}.{attr}" if prefix else attr
            if id(p) in seen:
                i = seen[id(p)]
                params[i] = replace(params[i], aliases=(*params[i].aliases, fqn))
                continue
            seen[id(p)] = len(params)
            shape = _global_shape(p)
            params.append(
                ParamPlan(
                    fqn=fqn,
                    global_shape=shape,
                    dtype=str(p.dtype).removeprefix("torch."),
                    layout=Layout(shape, mesh, [Replicate()]),
                    module=prefix,
                )
            )
    return ParallelPlan(mesh, "replica", (), "production", (), tuple(params))


def _global_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(layout_of(p).global_shape)
