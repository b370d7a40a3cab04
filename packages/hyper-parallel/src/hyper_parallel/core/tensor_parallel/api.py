"""``hyper_parallel.core.tensor_parallel.api``: upstream's (PyTorch-shaped)
``parallelize_module(module, device_mesh, parallelize_plan, *, src_data_rank=0)`` on
``hp_dtensor.parallel.parallelize_module``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import Mode, ParallelStyle, ShardingPlan
from hp_dtensor.parallel import parallelize_module as hp_parallelize_module
from hp_dtensor.watchdog import watch
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["parallelize_module"]

_M = TypeVar("_M", bound=nn.Module)


def _broadcast_from(module: nn.Module, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Every (non-meta) parameter and buffer of ``module`` takes mesh rank ``src_data_rank``'s
    values (the whole tensors every rank shards from)."""
    ranks = mesh.mesh.ranks
    if not 0 <= src_data_rank < len(ranks):
        raise ValueError(
            f"parallelize_module: src_data_rank={src_data_rank} is not a rank of the mesh "
            f"{mesh!r} (0 <= src_data_rank < {len(ranks)}); pass None to keep each rank's own "
            "values"
        )
    group = mesh.get_mesh_group()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                with watch("broadcast (parallelize_module src_data_rank)", group):
                    dist.broadcast(tensor.data, src=ranks[src_data_rank], group=group)


@adapts(
    "hp_dtensor.parallel.parallelize_module",
    "upstream's `parallelize_plan=` (a style or a dict) and `src_data_rank=` (broadcast first)",
)
def parallelize_module(
    module: _M,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle | ShardingPlan] | None = None,
    *,
    src_data_rank: int | None = 0,
    mode: Mode = "production",
    tp_axis: str | None = None,
    dp_axes: Sequence[str] | None = None,
) -> _M:
    """Shard ``module`` in place by tensor-parallel styles over ``device_mesh``; return it.

    Args:
        module: the model.
        device_mesh: the (1-d tensor-parallel) mesh; with several axes, ``tp_axis`` names the
            parallel one.
        parallelize_plan: a style for ``module`` itself, or module-name patterns (``*``
            matches one dotted component) to styles (``ColwiseParallel()``, ...).
        src_data_rank: the mesh rank whose whole parameters every rank shards (broadcast
            first, as upstream and torch); None: each rank shards its own (identical) copy.
        mode, tp_axis, dp_axes: hp-dtensor's options (``"production"`` runs plain local
            tensors, ``"validation"`` DTensors checked op by op); see
            ``hp_dtensor.parallel.parallelize_module``.

    Raises:
        NotOfferedError: no ``device_mesh`` (upstream's mesh context).
        hp_dtensor.parallel.PlanError: a pattern that names no module, a style that cannot
            shard the module it names.
    """
    if device_mesh is None:
        raise not_offered(
            "parallelize_module without a device_mesh (upstream's `with mesh:` context)",
            "pass the tensor-parallel mesh, e.g. parallelize_module(model, mesh['tp'], plan)",
        )
    if parallelize_plan is None:
        warnings.warn(
            "parallelize_module: no parallelize_plan given, so nothing is parallelized",
            stacklevel=2,
        )
        return module
    plan: Mapping[str, ParallelStyle | ShardingPlan]
    if isinstance(parallelize_plan, ParallelStyle | ShardingPlan):
        plan = {"": parallelize_plan}
    elif isinstance(parallelize_plan, Mapping):
        plan = parallelize_plan
    else:
        raise TypeError(
            "parallelize_module: parallelize_plan must be a ParallelStyle or a dict of module "
            f"names to styles, got {type(parallelize_plan).__name__}"
        )
    if src_data_rank is not None:
        _broadcast_from(module, device_mesh, src_data_rank)
    hp_parallelize_module(module, device_mesh, plan, mode=mode, tp_axis=tp_axis, dp_axes=dp_axes)
    return module
