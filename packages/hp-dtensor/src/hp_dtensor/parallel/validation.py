"""Validation mode: the same plan run on DTensors, checked op by op against production mode.

Parameters become DTensor parameters; module boundaries convert DTensors between the plan's
layouts and *check* them: an input that arrives in another layout than the plan says, or an
output produced in another layout, raises :class:`PlanMismatchError` naming the module. Every
op inside the model runs through its sharding rule (layouts propagate) and is also run the way
production mode would run it -- the same function on the unredistributed local tensors -- and
the first op whose local result differs (another shape, other values, or an error) raises,
naming the module, the op, the input layouts and what the rule had to do (a redistribution or
a distributed computation). Modules whose forward the style replaces in production mode
(row-wise linear and embedding, sequence-parallel dropout) are checked at their boundaries only;
ops that take sizes (``view``, ``reshape``, ...) are checked for needed redistributions only,
because their size arguments come from shapes, which are global on DTensors.

Outside the model, plain tensors that meet its DTensors (a loss's targets, class weights) are
taken as replicated on its mesh, as production mode runs them
(:func:`hp_dtensor._dispatch.replicate_plain_tensors_on`); a plain tensor that requires grad
gets its true gradient on every rank.

Gradients of replicated parameters are reduced in backward (summed over every replicated axis:
the DTensor loss is global) so that, after backward, every gradient has its parameter's layout;
:func:`check_gradients` verifies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten

import hp_dtensor._dispatch as _dispatch
from hp_dtensor._dispatch import implicit_replication, replicate_plain_tensors_on
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor, distribute_tensor
from hp_dtensor.gradients import set_grad_layout
from hp_dtensor.parallel._grad_reduction import install_grad_reductions, set_grad_reduction
from hp_dtensor.parallel._structure import map_tensors, rebuild_sequence
from hp_dtensor.parallel.plan import Boundary, ShardingPlan
from hp_dtensor.parallel.resolved import ParallelPlan
from hp_layout import Layout, Placement, Replicate, Shard

__all__ = ["PlanMismatchError", "apply_validation", "check_gradients"]

_RANDOM_OPS = {
    "dropout",
    "alpha_dropout",
    "feature_dropout",
    "feature_alpha_dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "multinomial",
    "normal",
    "empty_like",
    "new_empty",
}


# Ops whose arguments are sizes. Model code takes sizes from tensor shapes, which are global on
# DTensors and local in production, so the two modes legitimately pass different arguments:
# for these ops only the need for a redistribution is checked, not a replay of the arguments.
_SIZE_ARGUMENT_OPS = {
    "view",
    "reshape",
    "expand",
    "unflatten",
    "broadcast_to",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "repeat",
}


class PlanMismatchError(RuntimeError):
    """Validation mode found a place where the plan and the model disagree."""


class _Tracker:
    """Where the forward is: the module path, and whether ops are being checked."""

    def __init__(self, axis_index: int) -> None:
        self.axis_index = axis_index  # the parallel axis, in the mesh's axes
        self.path: list[str] = []
        self.skip_depth = 0
        self.active = 0  # 1 while the parallelized model's forward runs
        self._context: contextlib.AbstractContextManager[None] | None = None
        self.observer = _observer(self)

    def where(self) -> str:
        return self.path[-1] if self.path else "<root>"

    def begin(self) -> None:
        """The parallelized model's forward starts: check its ops (the observer is registered
        only while it runs), and take tensors the model creates itself (positions, masks) as
        replicated data."""
        self.end()
        self.path.clear()
        self.skip_depth = 0
        self.active = 1
        _dispatch.OBSERVERS.append(self.observer)
        self._context = implicit_replication()
        self._context.__enter__()

    def end(self) -> None:
        """The forward is over (or raised): stop checking ops."""
        self.active = 0
        if self.observer in _dispatch.OBSERVERS:
            _dispatch.OBSERVERS.remove(self.observer)
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)


def _placement(x: DTensor, index: int) -> Placement:
    return x.placements[index]


def _normalized(placement: Placement | None, ndim: int) -> Placement | None:
    """``Shard(-1)`` and ``Shard(ndim - 1)`` are the same placement."""
    if isinstance(placement, Shard) and ndim:
        return Shard(placement.dim % ndim)
    return placement


def _with_axis(x: DTensor, index: int, placement: Placement) -> list[Placement]:
    placements = list(x.placements)
    placements[index] = placement
    return placements


def _observer(tracker: _Tracker) -> _dispatch.OpObserver:
    def observe(
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dtensors: Sequence[DTensor],
        prepared: Any,
        result: Any,
    ) -> None:
        if not tracker.active or tracker.skip_depth:
            return
        name = getattr(func, "__name__", str(func)).strip("_")
        if name in _RANDOM_OPS:
            return
        layouts = ", ".join(repr(t.dist_layout) for t in dtensors)
        where = f"op {name!r} in module {tracker.where()!r} with input layouts [{layouts}]"
        reasons = [
            f"input {i} had to be redistributed to {plan.dst!r}"
            for i, plan in enumerate(prepared.plans)
            if plan is not None
        ]
        if prepared.inplace_self or name in _SIZE_ARGUMENT_OPS:
            if reasons:
                raise PlanMismatchError(f"{where}: {'; '.join(reasons)}")
            return
        if _split_on_data_axes_only(dtensors, tracker.axis_index):
            # Production mode runs such an op as one data-parallel replica does (a loss inside
            # the model is its local batch's mean; gradients are averaged over the data axes as
            # in DDP): the plan, which is about the parallel axis, leaves it alone.
            return
        _compare_with_production(func, args, kwargs, result, where, reasons)

    return observe


def _split_on_data_axes_only(dtensors: Sequence[DTensor], axis_index: int) -> bool:
    """Every input replicated on the parallel axis, and some input split on another axis."""
    return all(isinstance(t.placements[axis_index], Replicate) for t in dtensors) and any(
        not isinstance(p, Replicate) for t in dtensors for p in t.placements
    )


def _as_local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach()
    if isinstance(value, tuple | list) and not hasattr(value, "_fields"):
        return type(value)(_as_local(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_local(v) for k, v in value.items()}
    return value


def _compare_with_production(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result: Any,
    where: str,
    reasons: list[str],
) -> None:
    because = f" ({'; '.join(reasons)})" if reasons else ""
    try:
        with torch.no_grad(), DisableTorchFunctionSubclass():
            shadow = func(*_as_local(args), **_as_local(kwargs))
    except Exception as exc:
        raise PlanMismatchError(
            f"{where}: production mode would run it on local tensors and fail with "
            f"{type(exc).__name__}: {exc}{because}"
        ) from exc
    got, _ = tree_flatten(_as_local(result))
    want, _ = tree_flatten(shadow)
    for g, w in zip(got, want, strict=False):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape:
            raise PlanMismatchError(
                f"{where}: the plan's layouts give a local result of shape {tuple(g.shape)}, "
                f"production mode would compute shape {tuple(w.shape)}{because}"
            )
        same = (
            torch.allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
            if g.dtype.is_floating_point
            else torch.equal(g, w)
        )
        if not same:
            error = (g.double() - w.double()).abs().max().item() if g.numel() else 0.0
            raise PlanMismatchError(
                f"{where}: production mode would compute other local values (max difference "
                f"{error:.3g}){because or ' (the op needs a distributed computation)'}"
            )


def _to_dtensor(
    value: torch.Tensor, mesh: DeviceMesh, index: int, dp_axes: Sequence[str], layout: Placement
) -> DTensor:
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for axis in dp_axes:
        if value.dim() > 0:
            placements[mesh.mesh.axis_index(axis)] = Shard(0)
    placements[index] = layout
    return DTensor.from_local(value, mesh, placements)


def apply_validation(root: nn.Module, mesh: DeviceMesh, resolved: ParallelPlan) -> None:
    """Convert ``root`` in place for validation mode (see the module docstring), as the
    resolved plan says."""
    axis, dp_axes = resolved.tp_axis, resolved.dp_axes
    index = mesh.mesh.axis_index(axis)
    tracker = _Tracker(index)
    # The script around the model (its loss against plain targets, say) mixes the model's
    # DTensors with plain tensors that production mode runs as one value on every rank.
    replicate_plain_tensors_on(mesh)
    done: dict[int, nn.Parameter] = {}
    for prefix, module in root.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in done:
                setattr(module, name, done[id(param)])
                continue
            planned = resolved.param(f"{prefix}.{name}" if prefix else name)
            dtensor = _param_dtensor(param, mesh, planned.layout.placements)
            new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            if planned.reduction is not None:
                set_grad_reduction(new, mesh, planned.reduction.axes)
                # After the reduction the gradient has the parameter's layout.
                set_grad_layout(new, dtensor.dist_layout)
            done[id(param)] = new
            setattr(module, name, new)

    for module in root.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and not isinstance(buffer, DTensor):
                # Buffers (rotary tables, masks) are replicated data the ops mix with DTensors.
                module._buffers[name] = _param_dtensor(buffer, mesh, (Replicate(),) * mesh.ndim)

    def convert(value: Any, boundary: Boundary, what: str, module_name: str, style: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        ndim = value.dim()
        expected = _normalized(boundary.layout, ndim)
        if not isinstance(value, DTensor):
            value = _to_dtensor(value, mesh, index, dp_axes, expected or Replicate())
        elif expected is not None and _placement(value, index) != expected:
            raise PlanMismatchError(
                f"module {module_name!r} ({style}): {what} is {value.dist_layout!r} on mesh axis "
                f"{axis!r} but the plan says {boundary.layout!r}"
            )
        target = _normalized(boundary.target, ndim)
        if target is None or target == _placement(value, index):
            return value
        return value.redistribute(placements=_with_axis(value, index, target))

    def lift(value: torch.Tensor) -> torch.Tensor:
        # The model's own inputs (token ids, masks, positions) enter as plain tensors: they are
        # replicated on the parallel axis and split by batch over the data axes.
        if isinstance(value, DTensor):
            return value
        return _to_dtensor(value, mesh, index, dp_axes, Replicate())

    styled = {m.name: m.sharding for m in resolved.modules}
    for name, sharding in styled.items():
        if sharding.behaviour is not None:
            # Expert and context parallelism run on local shards, as in production.
            sharding.behaviour.install_validation_forward(
                root.get_submodule(name), sharding, mesh, axis
            )
    for name, module in root.named_modules():
        plan = styled.get(name)
        is_root = module is root
        module.register_forward_pre_hook(
            _validation_pre_hook(tracker, name, plan, convert, lift if is_root else None),
            with_kwargs=True,
        )
        # always_call: a forward that raises still leaves the tracker inactive.
        module.register_forward_hook(
            _validation_post_hook(tracker, name, plan, convert, is_root), always_call=True
        )
    install_grad_reductions(root)


def _param_dtensor(
    param: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> DTensor:
    if param.is_meta:
        layout = Layout(tuple(param.shape), mesh.mesh, placements)
        local = torch.empty(layout.local_shape(mesh.get_rank()), dtype=param.dtype, device="meta")
        return DTensor(local, layout, mesh)
    return distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)


_Convert = Callable[[Any, Boundary, str, str, str], Any]


def _at_boundary(
    convert: _Convert, value: Any, boundary: Boundary | None, what: str, name: str, style: str
) -> Any:
    return value if boundary is None else convert(value, boundary, what, name, style)


def _validation_pre_hook(
    tracker: _Tracker,
    name: str,
    plan: ShardingPlan | None,
    convert: _Convert,
    lift: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Callable[..., Any]:
    """``lift`` (the root only) turns the plain tensors the caller passes into DTensors."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if lift is not None:
            tracker.begin()
        if plan is not None:
            args = tuple(
                _at_boundary(convert, a, plan.input_boundary(i), f"input {i}", name, plan.style)
                for i, a in enumerate(args)
            )
            kwargs = {
                k: convert(v, plan.kwarg_inputs[k], f"input {k!r}", name, plan.style)
                if k in plan.kwarg_inputs
                else v
                for k, v in kwargs.items()
            }
            if plan.replaces_forward:
                tracker.skip_depth += 1
        if lift is not None:
            where = f"the input of {type(module).__name__}"
            args, kwargs = map_tensors(lift, (args, kwargs), where=where)
        tracker.path.append(name or "<root>")
        return args, kwargs

    return hook


def _validation_post_hook(
    tracker: _Tracker, name: str, plan: ShardingPlan | None, convert: _Convert, is_root: bool
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if tracker.path:
            tracker.path.pop()
        if output is None and is_root:
            tracker.end()
            return output
        if plan is not None:
            if plan.replaces_forward:
                tracker.skip_depth -= 1
            outputs = plan.outputs
            if isinstance(outputs, Boundary):
                output = convert(output, outputs, "its output", name, plan.style)
            elif outputs is not None:
                output = rebuild_sequence(
                    output,
                    [
                        convert(v, b, f"output {i}", name, plan.style) if b is not None else v
                        for i, (v, b) in enumerate(zip(output, outputs, strict=True))
                    ],
                )
        if is_root:
            tracker.end()
        return output

    return hook


def check_gradients(module: nn.Module) -> None:
    """After backward in validation mode: every DTensor parameter's gradient must have the
    parameter's layout (replicated gradients reduced). Raises naming the first that does not."""
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor) or param.grad is None:
            continue
        grad = param.grad
        assert isinstance(grad, DTensor)
        if grad.dist_layout != param.dist_layout:
            raise PlanMismatchError(
                f"gradient of parameter {name!r} has layout {grad.dist_layout!r}, its parameter "
                f"{param.dist_layout!r}"
            )
        if grad.to_local().shape != param.to_local().shape:
            raise PlanMismatchError(
                f"gradient of parameter {name!r} has local shape {tuple(grad.to_local().shape)}, "
                f"its parameter {tuple(param.to_local().shape)}"
            )
