"""``parallelize_module``: apply a sharding plan to a module, in production or validation mode."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel._plan_record import record_parallel_plan
from hp_dtensor.parallel.plan import ShardingPlan
from hp_dtensor.parallel.production import apply_production
from hp_dtensor.parallel.resolved import resolve
from hp_dtensor.parallel.siblings import check_sibling_projections
from hp_dtensor.parallel.styles import ParallelStyle
from hp_dtensor.parallel.validation import apply_validation

__all__ = ["Mode", "parallelize_module"]

Mode = Literal["production", "validation"]


def _our_mesh(device_mesh: object) -> DeviceMesh:
    """Ours as it is; a torch ``DeviceMesh`` bound (:meth:`DeviceMesh.from_torch`: its own
    process groups); anything else refused by name."""
    if isinstance(device_mesh, DeviceMesh):
        return device_mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if isinstance(device_mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(device_mesh)
    raise TypeError(
        f"parallelize_module: device_mesh is a {type(device_mesh).__name__}; give an "
        "hp_dtensor.DeviceMesh or a torch.distributed.device_mesh.DeviceMesh"
    )


def _as_plan(plan: object) -> Mapping[str, ParallelStyle | ShardingPlan]:
    """A plan mapping; a bare style (or ShardingPlan) applies to the module itself, as torch's
    ``parallelize_module(module, mesh, ColwiseParallel())``."""
    if isinstance(plan, ParallelStyle | ShardingPlan):
        return {"": plan}
    if isinstance(plan, Mapping):
        return plan
    raise TypeError(
        f"parallelize_module: plan is a {type(plan).__name__}; give a style (applied to the "
        "module itself) or a mapping of module-name patterns to styles"
    )


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | Any = None,
    plan: Mapping[str, ParallelStyle | ShardingPlan] | ParallelStyle | ShardingPlan | None = None,
    *,
    parallelize_plan: Mapping[str, ParallelStyle | ShardingPlan]
    | ParallelStyle
    | ShardingPlan
    | None = None,
    src_data_rank: int | None = None,
    mode: Mode = "production",
    tp_axis: str | None = None,
    dp_axes: Sequence[str] | None = None,
) -> nn.Module:
    """Shard ``module`` in place by ``plan`` over ``tp_axis`` of ``device_mesh``; return it.

    Args:
        module: the model (on CPU, an accelerator, or ``meta`` for deferred initialization).
        device_mesh: the mesh (ours, or a ``torch.distributed.device_mesh.DeviceMesh``, whose
            process groups are then used); with several axes, ``tp_axis`` names the
            tensor-parallel one (a torch mesh without names calls its axes ``dim0``, ...).
        plan: module-name patterns (each dotted component an ``fnmatch`` pattern, as torch's)
            to styles, or one style for ``module`` itself (torch's forms). Styles take
            ``hp_layout``'s or torch's placements. None warns and returns ``module`` as torch
            does.
        mode: ``"production"`` resolves everything now and runs plain tensors with planned
            collectives at module boundaries; ``"validation"`` runs DTensors and checks every
            op and boundary against the plan.
        tp_axis: the mesh axis the styles shard over (default: the only axis).
        dp_axes: axes over which inputs are split by batch (default: every other axis);
            gradients of parameters replicated there are reduced in backward.
        parallelize_plan: torch's name for ``plan`` (give one of the two).
        src_data_rank: torch's argument; only None is taken: each rank shards the values it
            holds (initialize the model identically on every rank, e.g. from one seed).

    The resolved plan (:func:`hp_dtensor.parallel.resolve`, what the executor applied) is then
    :func:`hp_dtensor.contract.parallel_plan_of` the module.

    Raises:
        PlanError: an entry names no module, a style cannot shard the module it names, a
            module is named twice, or (production mode) a Linear is left out of the plan while
            its look-alike sibling is column-parallel (see ``check_sibling_projections``).
    """
    if parallelize_plan is not None:
        if plan is not None:
            raise TypeError(
                "parallelize_module: got both plan and parallelize_plan (the same argument "
                "under hp's and torch's names); give one"
            )
        plan = parallelize_plan
    if src_data_rank is not None:
        raise NotImplementedError(
            f"parallelize_module(src_data_rank={src_data_rank}) (torch: scatter every "
            "parameter from that rank) is not implemented; each rank shards its own values, "
            "so initialize the model identically on every rank and pass src_data_rank=None"
        )
    if plan is None:
        # torch's parallelize_module without a plan: a warning, and the module as it is.
        warnings.warn(
            "parallelize_module: no parallelize_plan given, so the module is left as it is",
            UserWarning,
            stacklevel=2,
        )
        return module
    plan = _as_plan(plan)
    if device_mesh is None:
        raise TypeError(
            "parallelize_module needs device_mesh: hp has no current-mesh context (torch's "
            "`with mesh:`); pass the mesh"
        )
    device_mesh = _our_mesh(device_mesh)
    resolved = resolve(module, device_mesh, plan, mode=mode, tp_axis=tp_axis, dp_axes=dp_axes)
    if mode == "production":
        # Validation mode finds these at run time, naming the op; production mode would not.
        check_sibling_projections(module, [(m.name, m.sharding) for m in resolved.modules])
        apply_production(module, device_mesh, resolved)
    else:
        apply_validation(module, device_mesh, resolved)
    record_parallel_plan(module, resolved)
    return module
