"""``parallelize_module``: apply a sharding plan to a module, in production or validation mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel._plan_record import record_parallel_plan
from hp_dtensor.parallel.plan import ShardingPlan, check_sibling_projections
from hp_dtensor.parallel.production import apply_production
from hp_dtensor.parallel.resolved import resolve
from hp_dtensor.parallel.styles import ParallelStyle
from hp_dtensor.parallel.validation import apply_validation

__all__ = ["Mode", "parallelize_module"]

Mode = Literal["production", "validation"]


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

    The resolved plan (:func:`hp_dtensor.parallel.resolve`, what the executor applied) is then
    :func:`hp_dtensor.contract.parallel_plan_of` the module.

    Raises:
        PlanError: an entry names no module, a style cannot shard the module it names, a
            module is named twice, or (production mode) a Linear is left out of the plan while
            its look-alike sibling is column-parallel (see ``check_sibling_projections``).
    """
    resolved = resolve(module, device_mesh, plan, mode=mode, tp_axis=tp_axis, dp_axes=dp_axes)
    if mode == "production":
        # Validation mode finds these at run time, naming the op; production mode would not.
        check_sibling_projections(module, [(m.name, m.sharding) for m in resolved.modules])
        apply_production(module, device_mesh, resolved)
    else:
        apply_validation(module, device_mesh, resolved)
    record_parallel_plan(module, resolved)
    return module
