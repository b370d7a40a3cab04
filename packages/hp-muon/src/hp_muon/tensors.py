"""The local data behind any parameter kind Muon accepts, and state tensors shaped like it.

Kinds: a plain tensor (whole, on this rank), a plain tensor annotated with its layout
(``hp_dtensor.annotate_layout``: hp-fsdp's flat pieces, hp-dtensor production-mode TP), our
``hp_dtensor.DTensor`` and torch's ``DTensor`` (FSDP2, TP, HSDP). Muon computes on the local
data only; the layout (``hp_dtensor.layout_of``) says what the local data is a piece of.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor as TorchDTensor

from hp_dtensor import DTensor, annotate_layout, layout_of
from hp_dtensor.interop import LAYOUT_ATTRIBUTE, torch_dtensor_like
from hp_layout import Layout, Mesh, Replicate

__all__ = [
    "global_shape",
    "is_plain",
    "like_param",
    "local_data",
    "local_grad",
    "planning_layout",
]


def local_data(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``t`` (shares storage with ``t``)."""
    if isinstance(t, (DTensor, TorchDTensor)):
        return t.to_local()
    return t


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor carrying no layout (neither a DTensor nor annotated)."""
    return not isinstance(t, (DTensor, TorchDTensor)) and getattr(t, LAYOUT_ATTRIBUTE, None) is None


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter (an annotated local piece reports its layout's)."""
    if isinstance(param, (DTensor, TorchDTensor)) or is_plain(param):
        return tuple(param.shape)
    return layout_of(param).global_shape


def planning_layout(param: torch.Tensor, replicas: Mesh | None) -> Layout:
    """The layout Muon plans ``param`` with: its own (``layout_of``), except that a plain
    parameter is taken as replicated over ``replicas`` when given (data parallelism: every
    rank holds the same parameter and the same, already averaged, gradient)."""
    if replicas is not None and is_plain(param):
        return Layout(tuple(param.shape), replicas, [Replicate()])
    return layout_of(param)


def local_grad(param: torch.Tensor, index: int) -> torch.Tensor:
    """The local data of ``param.grad``, checked to be laid out like the parameter.

    Raises:
        ValueError: the gradient has another layout (e.g. a ``Partial`` one not yet reduced)
            or another local shape than the parameter.
    """
    grad = param.grad
    assert grad is not None
    if isinstance(param, TorchDTensor):
        if not isinstance(grad, TorchDTensor) or tuple(grad.placements) != tuple(param.placements):
            got = grad.placements if isinstance(grad, TorchDTensor) else type(grad).__name__
            raise ValueError(
                f"parameter {index}: its gradient is laid out as {got}, the parameter as "
                f"{param.placements}; Muon needs the reduced gradient laid out like its "
                "parameter (redistribute it first)"
            )
    elif isinstance(param, DTensor) and (
        not isinstance(grad, DTensor) or grad.dist_layout != param.dist_layout
    ):
        found = grad.dist_layout if isinstance(grad, DTensor) else type(grad).__name__
        raise ValueError(
            f"parameter {index}: its gradient is laid out as {found}, the parameter as "
            f"{param.dist_layout}; Muon needs the reduced gradient laid out like its "
            "parameter (redistribute it first)"
        )
    local, local_param = local_data(grad), local_data(param)
    if local.shape != local_param.shape:
        raise ValueError(
            f"parameter {index}: local gradient of shape {tuple(local.shape)} does not match the "
            f"local parameter of shape {tuple(local_param.shape)}"
        )
    return local


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped like ``param``'s local data) wrapped as the same kind as ``param``,
    so that optimizer state is laid out, and checkpointed, like its parameter."""
    if isinstance(param, TorchDTensor):
        return torch_dtensor_like(local, param)
    if isinstance(param, DTensor):
        return DTensor(local, param.dist_layout, param.device_mesh)
    if not is_plain(param):
        return annotate_layout(local, layout_of(param))
    return local
