"""Production mode: plain local parameters and pre-planned collectives at module boundaries.

When a plan is applied, every parameter becomes a plain ``nn.Parameter`` holding this rank's
shard, annotated with its layout (``hp_dtensor.layout_of`` answers). Module boundaries get
forward hooks that run the planned redistributions (autograd functions with true adjoints);
inside modules every op runs on plain tensors: no DTensor, no per-op dispatch, no layout
inference. Styles that need a different local computation (row-wise bias, vocabulary-parallel
embedding, sequence-parallel dropout) replace the module's forward.

Gradient conventions: inside the model the local gradients are the true per-rank adjoints, so a
replicated value's gradient is a partial contribution. The user computes the loss on every
rank and calls ``loss.backward()`` with the gradient 1 everywhere; the root module's output
boundary turns that into adjoint pieces (the replica at coordinate 0 keeps it). Gradients of
replicated parameters are reduced in backward by hooks: summed over the parallel axis, averaged
over data-parallel axes (each data-parallel rank's loss is the mean over its own batch, as in
DDP).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.interop import annotate_layout
from hp_dtensor.parallel._boundary import BoundaryConverter
from hp_dtensor.parallel._grad_reduction import install_grad_reductions, set_grad_reduction
from hp_dtensor.parallel._structure import map_tensors, rebuild_sequence
from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan
from hp_dtensor.parallel.resolved import ParallelPlan
from hp_dtensor.redistribute import execute_plan
from hp_layout import Layout, Placement, Replicate, StepKind

__all__ = ["apply_production"]

# Tensors handed on by a boundary carry their placement on the parallel axis in this attribute
# (the root output hook reads it).
_PLACEMENT_ATTR = "_hp_dtensor_boundary_placement"


def _placement_of(value: torch.Tensor) -> Placement:
    placement = getattr(value, _PLACEMENT_ATTR, None)
    return placement if placement is not None else Replicate()


class _ExactToAdjoint(torch.autograd.Function):
    """Identity forward. Backward: the caller's gradient of a replicated output is the same on
    every rank; the adjoint convention inside wants it once, at coordinate 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.keep else torch.zeros_like(grad)), None


_GATHERED_FROM_ATTR = "_hp_dtensor_gathered_from"


class _GatheredOutput(torch.autograd.Function):
    """The model's gathered output, connected straight to the local shard it came from: the
    caller's gradient is whole on every rank, so the shard's gradient is its slice."""

    @staticmethod
    def forward(
        ctx: Any, source: torch.Tensor, gathered: torch.Tensor, box: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        ctx.box = box
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad
        for d, (a, b) in enumerate(ctx.box):
            out = out.narrow(d, a, b - a)
        return out, None, None


def _moves(boundary: Boundary | None) -> bool:
    """True when a boundary may convert (a known source equal to its target does not)."""
    return boundary is not None and not (
        boundary.layout is not None
        and (boundary.desired is None or boundary.desired == boundary.layout)
    )


def _local_param(param: nn.Parameter, layout: Layout, rank: int) -> nn.Parameter:
    region = layout.local_region(rank)
    if param.is_meta:
        local = torch.empty(region.shape, dtype=param.dtype, device="meta")
    else:
        local = param.detach()
        for d, (a, b) in enumerate(region.box):
            local = local.narrow(d, a, b - a)
        if region.flat is not None:
            local = local.reshape(-1)[region.flat[0] : region.flat[1]]
        local = local.clone()
    out = nn.Parameter(local, requires_grad=param.requires_grad)
    annotate_layout(out, layout, rank=rank)
    return out


def _convert_all(
    value: Any,
    boundary: Boundary | tuple[Boundary | None, ...] | None,
    convert: Callable[[torch.Tensor, Boundary], torch.Tensor],
) -> Any:
    if boundary is None:
        return value
    if isinstance(boundary, Boundary):
        return convert(value, boundary) if isinstance(value, torch.Tensor) else value
    if not isinstance(value, tuple | list) or len(value) != len(boundary):
        raise TypeError(
            f"the plan gives {len(boundary)} output boundaries but the module returned "
            f"{type(value).__name__}"
        )
    return rebuild_sequence(
        value,
        [
            convert(v, b) if b is not None and isinstance(v, torch.Tensor) else v
            for v, b in zip(value, boundary, strict=True)
        ],
    )


def apply_production(root: nn.Module, mesh: DeviceMesh, resolved: ParallelPlan) -> None:
    """Convert ``root`` in place for production mode (see the module docstring), as the
    resolved plan says."""
    rank = mesh.get_rank()
    axis = resolved.tp_axis
    axis_mesh = mesh[axis]
    converter = BoundaryConverter(axis_mesh)
    coordinate = mesh.get_local_rank(axis)
    done: dict[int, nn.Parameter] = {}
    for prefix, module in root.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in done:
                setattr(module, name, done[id(param)])
                continue
            planned = resolved.param(f"{prefix}.{name}" if prefix else name)
            local = _local_param(param, planned.layout, rank)
            if planned.reduction is not None:
                set_grad_reduction(local, mesh, planned.reduction.axes)
            done[id(param)] = local
            setattr(module, name, local)

    def convert(value: torch.Tensor, boundary: Boundary) -> torch.Tensor:
        src = boundary.layout if boundary.layout is not None else _placement_of(value)
        dst = boundary.target or src
        plan = converter.plan(value, src, dst)
        out = value if plan is None else execute_plan(value, plan, axis_mesh)
        setattr(out, _PLACEMENT_ATTR, dst)
        if plan is not None and all(s.kind is StepKind.ALL_GATHER for s in plan.steps):
            # If this turns out to be the model's output, its backward can slice (see below).
            setattr(out, _GATHERED_FROM_ATTR, (value, plan))
        return out

    for planned_module in resolved.modules:
        name, plan = planned_module.name, planned_module.sharding
        module = root.get_submodule(name)
        _install_production_forward(module, plan, axis_mesh, coordinate)
        if any(_moves(b) for b in (*plan.inputs, *plan.kwarg_inputs.values())):
            module.register_forward_pre_hook(_pre_hook(plan, convert), with_kwargs=True)
        if plan.outputs is not None:
            module.register_forward_hook(_post_hook(plan, convert))
        if isinstance(module, nn.Linear):
            _check_first_input(module, name, plan)
    root.register_forward_hook(_root_output_hook(coordinate, axis_mesh.get_rank()))
    install_grad_reductions(root)


def _check_first_input(module: nn.Linear, name: str, plan: ShardingPlan) -> None:
    """On the first call, check that what arrives fits the local weight, so that a style that
    does not fit its neighbours fails as a plan error naming the module instead of a shape
    error deep inside a matmul; the hook then removes itself (no cost in the steady state)."""

    def hook(module: nn.Linear, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != module.weight.shape[-1]:
            raise PlanError(
                f"module {name!r} ({plan.style}): its input arrives with {x.shape[-1]} features "
                f"on this rank but its local weight {tuple(module.weight.shape)} takes "
                f"{module.weight.shape[-1]}; the layout the plan gives this input does not "
                "match what the module before it hands on (e.g. a ColwiseParallel output "
                "feeding a module that is not RowwiseParallel)"
            )
        handle.remove()

    handle = module.register_forward_pre_hook(hook)


def _pre_hook(
    plan: ShardingPlan, convert: Callable[[torch.Tensor, Boundary], torch.Tensor]
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        new_args = tuple(
            _convert_all(a, plan.input_boundary(i), convert) for i, a in enumerate(args)
        )
        new_kwargs = {
            k: convert(v, plan.kwarg_inputs[k])
            if k in plan.kwarg_inputs and isinstance(v, torch.Tensor)
            else v
            for k, v in kwargs.items()
        }
        return new_args, new_kwargs

    return hook


def _post_hook(
    plan: ShardingPlan, convert: Callable[[torch.Tensor, Boundary], torch.Tensor]
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return _convert_all(output, plan.outputs, convert)

    return hook


def _root_output_hook(coordinate: int, rank: int) -> Callable[..., Any]:
    def adjoint(value: torch.Tensor) -> torch.Tensor:
        placement = _placement_of(value)
        if not isinstance(placement, Replicate) or not value.requires_grad:
            return value
        gathered = getattr(value, _GATHERED_FROM_ATTR, None)
        if gathered is not None:
            # Gathered shards whose gradient arrives whole on every rank: each rank's shard
            # gradient is its slice, with no collective (instead of a reduce-scatter of the
            # adjoint pieces).
            source, plan = gathered
            box = plan.src.local_region(rank).box
            sliced: torch.Tensor = _apply(_GatheredOutput)(source, value.detach(), box)
            return sliced
        out: torch.Tensor = _apply(_ExactToAdjoint)(value, coordinate == 0)
        return out

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        # Every tensor the model hands out, wherever it sits (a loss inside a ModelOutput, a
        # dict of heads): one skipped would keep every rank's gradient and scale the
        # parameters' gradients by the axis size.
        return map_tensors(adjoint, output, where=f"the output of {type(module).__name__}")

    return hook


def _install_production_forward(
    module: nn.Module, plan: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
) -> None:
    if not plan.replaces_forward:
        return
    style = plan.behaviour
    forward = (
        None if style is None else style.production_forward(module, plan, axis_mesh, coordinate)
    )
    if forward is None:
        raise NotImplementedError(
            f"{plan.style} replaces the forward of {type(module).__name__} in production mode, "
            "but gives no production forward for it"
        )
    object.__setattr__(module, "forward", types.MethodType(forward, module))
