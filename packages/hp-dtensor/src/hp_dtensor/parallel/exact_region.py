"""A module run in the exact gradient convention inside a model that uses the adjoint one.

Two conventions exist for the gradient of a value replicated over a tensor-parallel axis:

* **adjoint** (this package's production plans, DTensor's ``Partial``): each rank holds a
  partial gradient and the true gradient is their sum; replicated parameters' gradients are
  summed over the axis afterwards (``hp_dtensor.contract.grad_reduction_of``);
* **exact** (Megatron's): every rank holds the whole gradient; an all-reduce in backward at
  the entry of a tensor-parallel region makes it so, and replicated parameters need no sum.

A module written for the exact convention (expert parallelism with ``tp > 1``:
:mod:`hp_dtensor.parallel.expert`) placed in a model of the adjoint one would see partial
output gradients and give partial parameter gradients that nothing sums.
:func:`run_in_exact_region` brackets its forward: the output's gradient is all-reduced over
the axis (partial -> exact) and the input's gradient is handed back as a partial one (exact ->
partial: the whole gradient on the axis's coordinate 0, zeros on the others, so the sum is
exact and no rounding is added). The forward is unchanged; the backward costs one all-reduce
of the output's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hp_dtensor._comm as _comm
from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel._region import _ExactToPartial, _PartialToExact, keep_edge_outermost

__all__ = ["exact_gradients_of", "partial_gradients_of", "run_in_exact_region"]

_MARK = "_hp_dtensor_exact_region_axis"


def exact_gradients_of(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """``x`` unchanged; its gradient, partial over ``axis`` of ``mesh``, reaches what made
    ``x`` summed over the axis (exact on every rank). Collective in backward."""
    return _apply(_PartialToExact)(x, _comm.AxisGroup.of(mesh, axis))


def partial_gradients_of(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """``x`` unchanged; its gradient, exact (the same) on every rank of ``axis``, reaches what
    made ``x`` as a partial one: whole on the axis's coordinate 0, zeros elsewhere."""
    return _apply(_ExactToPartial)(x, _comm.AxisGroup.of(mesh, axis))


def run_in_exact_region(module: nn.Module, mesh: DeviceMesh, axis: str) -> None:
    """Make ``module`` (one tensor in, one out, already parallelized) run in the exact
    convention over ``axis`` of ``mesh`` inside a model of the adjoint one (module
    docstring), by a forward pre-hook on its input and a forward hook on its output. The
    output hook runs after the hooks already registered (a production plan's output
    conversions), so what the module hands on is converted first.

    Raises:
        ValueError: ``module`` is in an exact region already.
    """
    if getattr(module, _MARK, None) is not None:
        raise ValueError(
            f"{type(module).__name__} already runs in an exact region over "
            f"{getattr(module, _MARK)!r}; bracket it once"
        )

    def enter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        first, *rest = args
        return (partial_gradients_of(first, mesh, axis), *rest)

    def leave(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return exact_gradients_of(out, mesh, axis)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
    # Called by the caller itself, the module's edge converts what leaves the exact region.
    keep_edge_outermost(module)
    setattr(module, _MARK, axis)
