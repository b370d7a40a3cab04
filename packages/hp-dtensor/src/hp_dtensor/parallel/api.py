"""``parallelize_module``: apply a sharding plan to a module, in production or validation mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel.plan import (
    PlanError,
    ShardingPlan,
    check_sibling_projections,
    resolve_plan,
)
from hp_dtensor.parallel.production import apply_production
from hp_dtensor.parallel.styles import ParallelStyle
from hp_dtensor.parallel.validation import apply_validation
from hp_layout import Placement, Replicate

__all__ = ["Mode", "parallelize_module"]

Mode = Literal["production", "validation"]


def _full_placements(
    placement: Placement | tuple[Placement, ...], mesh: DeviceMesh, axis_index: int, where: str
) -> tuple[Placement, ...]:
    if isinstance(placement, tuple):
        if len(placement) != mesh.ndim:
            raise PlanError(
                f"{where}: {len(placement)} placements for a {mesh.ndim}-axis mesh; give one per "
                "axis, or a single placement for the parallel axis"
            )
        return placement
    out: list[Placement] = [Replicate()] * mesh.ndim
    out[axis_index] = placement
    return tuple(out)


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    plan: Mapping[str, ParallelStyle | ShardingPlan],
    *,
    mode: Mode = "production",
    tp_axis: str | None = None,
    dp_axes: Sequence[str] | None = None,
) -> nn.Module:
    """Shard ``module`` in place by ``plan`` over ``tp_axis`` of ``device_mesh``; return it.

    Args:
        module: the model (on CPU, an accelerator, or ``meta`` for deferred initialization).
        device_mesh: the mesh; with several axes, ``tp_axis`` names the tensor-parallel one.
        plan: module-name patterns (``*`` matches one dotted component) to styles.
        mode: ``"production"`` resolves everything now and runs plain tensors with planned
            collectives at module boundaries; ``"validation"`` runs DTensors and checks every
            op and boundary against the plan.
        tp_axis: the mesh axis the styles shard over (default: the only axis).
        dp_axes: axes over which inputs are split by batch (default: every other axis);
            gradients of parameters replicated there are reduced in backward.

    Raises:
        PlanError: an entry names no module, a style cannot shard the module it names, a
            module is named twice, or (production mode) a Linear is left out of the plan while
            its look-alike sibling is column-parallel (see ``check_sibling_projections``).
    """
    if mode not in ("production", "validation"):
        raise ValueError(f"mode must be 'production' or 'validation', got {mode!r}")
    names = device_mesh.mesh_dim_names
    if tp_axis is None:
        if device_mesh.ndim != 1:
            raise PlanError(f"{device_mesh!r} has several axes; say which is tp_axis")
        tp_axis = names[0]
    axis_index = device_mesh.mesh.axis_index(tp_axis)
    data_axes = tuple(n for n in names if n != tp_axis) if dp_axes is None else tuple(dp_axes)
    for axis in data_axes:
        device_mesh.mesh.axis_index(axis)
    lowered = resolve_plan(module, plan)
    if mode == "production":
        # Validation mode finds these at run time, naming the op; production mode would not.
        check_sibling_projections(module, lowered)
    placements: dict[int, tuple[Placement, ...]] = {}
    for name, sharding in lowered:
        submodule = module.get_submodule(name)
        for param_name, placement in sharding.params.items():
            param = submodule.get_parameter(param_name)  # dotted: a submodule's parameter
            where = f"parameter {name + '.' if name else ''}{param_name}"
            full = _full_placements(placement, device_mesh, axis_index, where)
            previous = placements.get(id(param))
            if previous is not None and previous != full:
                raise PlanError(
                    f"{where} is shared with another module that places it as {previous}; a "
                    f"shared parameter needs one placement, got {full} too"
                )
            placements[id(param)] = full
    apply = apply_production if mode == "production" else apply_validation
    apply(module, device_mesh, tp_axis, data_axes, lowered, placements)
    return module
