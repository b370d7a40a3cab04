"""Reduction of replicated parameters' gradients in backward, attached to the parameters.

A parallelized parameter that is replicated along some mesh axes gets partial gradients there
(each replica's contribution); a hook on its local tensor reduces them as they arrive. The
reduction is recorded on the parameter (``_hp_grad_reduction``) and installed by
:func:`install_grad_reductions`, so a parameter replaced later with the same attributes (as
deferred initialization does) gets its hook again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hp_dtensor import _comm
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_layout import ReduceOp

__all__ = ["GradReduction", "install_grad_reductions", "set_grad_reduction"]

_SPEC = "_hp_grad_reduction"
_OWNER = "_hp_grad_hook_owner"


@dataclass(frozen=True)
class GradReduction:
    """Reduce a gradient over ``axes`` of ``mesh``, each with its op.

    Attributes:
        mesh: the mesh of the parameter.
        axes: ``(axis, op)`` pairs, reduced in this order.
    """

    mesh: DeviceMesh
    axes: tuple[tuple[str, ReduceOp], ...]

    def hook(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gradient hook running the reductions."""
        groups = [(_comm.AxisGroup.of(self.mesh, axis), op) for axis, op in self.axes]

        def reduce(grad: torch.Tensor) -> torch.Tensor:
            for group, op in groups:
                grad = _comm.all_reduce(grad, op, group)
            return grad

        return reduce


def set_grad_reduction(
    param: torch.Tensor, mesh: DeviceMesh, axes: Sequence[tuple[str, ReduceOp]]
) -> None:
    """Record that ``param``'s gradient is reduced over ``axes`` (installed separately)."""
    setattr(param, _SPEC, GradReduction(mesh, tuple(axes)))


def install_grad_reductions(module: nn.Module) -> None:
    """Install the recorded reductions on every parameter of ``module`` that lacks its hook."""
    for param in module.parameters():
        spec = getattr(param, _SPEC, None)
        if spec is None or getattr(param, _OWNER, None) == id(param):
            continue
        if not param.requires_grad:
            continue
        leaf = param.to_local() if isinstance(param, DTensor) else param
        leaf.register_hook(spec.hook())
        setattr(param, _OWNER, id(param))
