"""Attribute-level DTensor handlers, answered before any sharding rule.

Metadata of the global tensor (shape, dtype, ...) comes from the wrapper; autograd bookkeeping
(requires_grad, grad_fn, is_leaf, .grad, backward) from the local tensor, which is the real
autograd variable, with gradients wrapped in the dual layout. ``F.l1_loss`` gets the ``weight``
torch leaves out of its ``__torch_function__`` call back before its rule runs.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._C import DisableTorchFunctionSubclass

from hp_dtensor._dispatch import dispatch
from hp_dtensor._routing import install_special
from hp_dtensor.dtensor import DTensor
from hp_dtensor.gradients import grad_layout, recorded_grad_layout
from hp_dtensor.redistribute import redistribute_local
from hp_layout import Partial, ReduceOp, Replicate

__all__ = ["SPECIAL"]


def _descriptor(name: str) -> Any:
    """The attribute descriptor of ``torch.Tensor.<name>`` (its getter and setter are what
    ``__torch_function__`` receives for attribute access)."""
    for klass in torch.Tensor.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def _unwrap(x: DTensor) -> torch.Tensor:
    return x._local


_Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _on_wrapper(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Metadata of the global tensor: answered by the wrapper itself."""
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _on_local(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Autograd bookkeeping: answered by the local tensor (the real autograd variable)."""
    self = args[0]
    assert isinstance(self, DTensor)
    with DisableTorchFunctionSubclass():
        return func(self._local, *args[1:], **kwargs)


def _get_grad(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    assert isinstance(self, DTensor)
    grad = self._local.grad
    if grad is None:
        return None
    # A parallelized parameter whose gradient was reduced in backward carries its layout.
    layout = recorded_grad_layout(self) or grad_layout(self._dist_layout)
    return DTensor(grad, layout, self._device_mesh)


def _set_grad(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, value = args[0], args[1]
    assert isinstance(self, DTensor)
    if value is None:
        self._local.grad = None
        return None
    if not isinstance(value, DTensor):
        raise TypeError(f"the grad of a DTensor must be a DTensor or None, got {type(value)}")
    wanted = grad_layout(self._dist_layout)
    with torch.no_grad():
        local = redistribute_local(value._local, value._dist_layout, wanted, self._device_mesh)
    self._local.grad = local
    return None


def _set_requires_grad(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    self = args[0]
    assert isinstance(self, DTensor)
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    self._local.requires_grad_(flag)
    with DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(self, flag)
    return self if func is torch.Tensor.requires_grad_ else None


def _get_data(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    assert isinstance(self, DTensor)
    return DTensor(self._local.data, self._dist_layout, self._device_mesh)


def _set_data(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self, value = args[0], args[1]
    assert isinstance(self, DTensor)
    if not isinstance(value, DTensor) or value._dist_layout != self._dist_layout:
        raise TypeError("DTensor.data can only be set to a DTensor with the same layout")
    self._local.data = value._local
    return None


def _seed(self: DTensor) -> torch.Tensor:
    """The local gradient seed of d(value)/d(value) = 1 in the dual layout."""
    factor = 1.0
    for axis, placement in zip(self._device_mesh.mesh_dim_names, self.placements, strict=True):
        if isinstance(placement, Replicate):
            if self._device_mesh.get_local_rank(axis) != 0:
                factor = 0.0
        elif isinstance(placement, Partial):
            if placement.op is ReduceOp.AVG:
                factor /= self._device_mesh.size(axis)
            elif placement.op is not ReduceOp.SUM:
                raise ValueError(
                    f"backward from a {placement!r} tensor needs the reduction first; "
                    "redistribute it to Replicate"
                )
    return torch.full_like(self._local, factor)


def _grad_seed(output: DTensor, gradient: Any) -> torch.Tensor:
    if gradient is None:
        if output.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        return _seed(output)
    if not isinstance(gradient, DTensor):
        raise TypeError("the gradient of a DTensor output must be a DTensor")
    for placement in output.placements:
        if isinstance(placement, Partial) and placement.op is not ReduceOp.SUM:
            raise ValueError(
                f"backward with an explicit gradient from a {placement!r} tensor is not "
                "supported; redistribute the output to Replicate first"
            )
    return redistribute_local(
        gradient._local,
        gradient._dist_layout,
        grad_layout(output._dist_layout),
        output._device_mesh,
    )


def _backward(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    assert isinstance(self, DTensor)
    gradient = args[1] if len(args) > 1 else kwargs.pop("gradient", None)
    rest = dict(kwargs)
    if "inputs" in rest and rest["inputs"] is not None:
        rest["inputs"] = [_unwrap(t) if isinstance(t, DTensor) else t for t in rest["inputs"]]
    torch.autograd.backward(self._local, _grad_seed(self, gradient), **rest)
    return None


def _autograd_grad(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    outputs = args[0] if args else kwargs.pop("outputs")
    inputs = args[1] if len(args) > 1 else kwargs.pop("inputs")
    grad_outputs = args[2] if len(args) > 2 else kwargs.pop("grad_outputs", None)
    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    ins = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    grads = (
        [None] * len(outs)
        if grad_outputs is None
        else ([grad_outputs] if isinstance(grad_outputs, torch.Tensor) else list(grad_outputs))
    )
    local_outs = [o._local if isinstance(o, DTensor) else o for o in outs]
    seeds = [
        _grad_seed(o, g) if isinstance(o, DTensor) else g for o, g in zip(outs, grads, strict=True)
    ]
    local_ins = [i._local if isinstance(i, DTensor) else i for i in ins]
    with DisableTorchFunctionSubclass():
        result = torch.autograd.grad(local_outs, local_ins, seeds, **kwargs)
    wrapped = tuple(
        DTensor(g, grad_layout(i._dist_layout), i._device_mesh)
        if isinstance(i, DTensor) and g is not None
        else g
        for i, g in zip(ins, result, strict=True)
    )
    return wrapped


def _deepcopy(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    memo = args[1] if len(args) > 1 else kwargs.get("memo", {})
    assert isinstance(self, DTensor)
    out = DTensor(copy.deepcopy(self._local, memo), self._dist_layout, self._device_mesh)
    if getattr(self, "_is_param", False):
        out._is_param = True
    memo[id(self)] = out
    return out


def _refuse_if_not_replicated(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    self = args[0]
    assert isinstance(self, DTensor)
    if not self._dist_layout.is_replicated:
        raise ValueError(
            f"{getattr(func, '__name__', func)} on a DTensor needs a fully replicated layout, "
            f"got {self._dist_layout!r}; call full_tensor() first"
        )
    with DisableTorchFunctionSubclass():
        return func(self._local, *args[1:], **kwargs)


def _same_device(value: Any, device: torch.device) -> bool:
    if not isinstance(value, torch.device | str):
        return False
    wanted = torch.device(value)
    return wanted.type == device.type and wanted.index in (None, device.index)


def _to(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``to(...)`` naming the device the DTensor is already on is no move (model code writes
    ``t.to(device=x.device, dtype=...)``); drop it and let the rule see the rest."""
    self = args[0]
    assert isinstance(self, DTensor)
    rest = tuple(a for a in args[1:] if not _same_device(a, self.device))
    kwargs = dict(kwargs)
    if _same_device(kwargs.get("device"), self.device):
        del kwargs["device"]
    if not rest and not {k for k in kwargs if k not in ("non_blocking", "copy")}:
        return self
    return dispatch(func, (self, *rest), kwargs)


def _argument_of_caller(func: Callable[..., Any], name: str) -> Any:
    """Argument ``name`` of the innermost running call of the Python function ``func``."""
    code = getattr(func, "__code__", None)
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get(name)
            frame = frame.f_back
        return None
    finally:
        del frame


def _l1_loss(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``F.l1_loss`` as its sharding rule must see it: torch (2.13) leaves ``weight`` out of
    the arguments it hands to ``__torch_function__`` (for every tensor subclass), which would
    compute the unweighted loss without a word; the weight is read back from the running
    ``F.l1_loss`` call."""
    if kwargs.get("weight") is None:
        weight = _argument_of_caller(F.l1_loss, "weight")
        if weight is not None:
            kwargs = {**kwargs, "weight": weight}
    return dispatch(func, args, kwargs)


def _metadata_functions() -> list[Any]:
    names_get = [
        "shape",
        "dtype",
        "device",
        "ndim",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
    ]
    funcs: list[Any] = [getattr(torch.Tensor, n).__get__ for n in names_get]
    funcs += [
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.__len__,
        torch.Tensor.get_device,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.is_floating_point,
        torch.is_complex,
        torch.is_tensor,
        torch.numel,
        torch.Tensor.__format__,
    ]
    return funcs


SPECIAL: dict[Any, _Handler] = {}
for _f in _metadata_functions():
    SPECIAL[_f] = _on_wrapper
for _name in ("is_leaf", "grad_fn", "_version", "requires_grad"):
    SPECIAL[_descriptor(_name).__get__] = _on_local
SPECIAL[torch.Tensor.retain_grad] = _on_local
SPECIAL[torch.Tensor.register_hook] = _on_local
SPECIAL[_descriptor("grad").__get__] = _get_grad
SPECIAL[_descriptor("grad").__set__] = _set_grad
SPECIAL[_descriptor("requires_grad").__set__] = _set_requires_grad
SPECIAL[torch.Tensor.requires_grad_] = _set_requires_grad
SPECIAL[_descriptor("data").__get__] = _get_data
SPECIAL[_descriptor("data").__set__] = _set_data
SPECIAL[torch.Tensor.backward] = _backward
SPECIAL[torch.autograd.grad] = _autograd_grad
SPECIAL[torch.Tensor.__deepcopy__] = _deepcopy
SPECIAL[torch.Tensor.to] = _to
for _f in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__):
    SPECIAL[_f] = _refuse_if_not_replicated
SPECIAL[F.l1_loss] = _l1_loss
install_special(SPECIAL)
