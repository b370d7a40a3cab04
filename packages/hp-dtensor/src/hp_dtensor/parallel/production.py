"""Production mode: plain local parameters and pre-planned collectives at module boundaries.

When a plan is applied, every parameter becomes a plain ``nn.Parameter`` holding this rank's
shard, annotated with its layout (``hp_dtensor.layout_of`` answers). Module boundaries run
the planned redistributions (autograd functions with true adjoints); inside modules every op
runs on plain tensors: no DTensor, no per-op dispatch, no layout inference. Styles that need a
different local computation (row-wise bias, vocabulary-parallel embedding, sequence-parallel
dropout) replace the module's forward.

Planning is separated from execution: each boundary's placements are fixed when the plan is
applied, and its conversion is compiled the first time it sees a local shape (sizes, dims,
slices, reductions all decided; see :mod:`hp_dtensor.parallel._boundary`); a call then only
looks the shape up and runs the compiled steps. A module that keeps its own forward gets
forward hooks for its boundaries (none for inputs that never move); a module whose forward the
style replaces runs its boundaries inside that forward (no hooks, so torch calls it on its
hook-free path), and where the style's forward returns a tensor nothing else holds (row-wise
parallel), a sum over the axis runs in place on it, as Megatron's hand-written ``g`` does. Such
a module's own forward hooks see its output after the conversion.

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
from hp_dtensor.parallel._boundary import BoundaryConverter, Move
from hp_dtensor.parallel._grad_reduction import install_grad_reductions, set_grad_reduction
from hp_dtensor.parallel._structure import map_tensors, rebuild_sequence
from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan
from hp_dtensor.parallel.resolved import ParallelPlan
from hp_layout import Layout, Placement, Replicate

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


_UNPLANNED = Move(())  # a cache miss (no real move is this object)


class _Edge:
    """One boundary of one module, planned: its placements decided at parallelize time, its
    conversion compiled the first time it sees a local shape (:class:`Move`), after which a
    call is a dictionary look-up and the move's steps.

    ``owned``: what arrives is the fresh result of a forward of ours, so a sum may run in place.
    """

    __slots__ = ("_moves", "converter", "dst", "owned", "src", "static")

    def __init__(self, boundary: Boundary, converter: BoundaryConverter, owned: bool) -> None:
        self.converter = converter
        self.src = boundary.layout
        self.dst = boundary.target
        self.owned = owned
        # A known source that is its own target never moves, whatever the shape.
        self.static = not _moves(boundary)
        self._moves: dict[Any, Move | None] = {}

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        if self.static:
            setattr(value, _PLACEMENT_ATTR, self.dst)
            return value
        src = self.src
        if src is None:
            # Whatever arrives: its placement is part of the key.
            src = _placement_of(value)
            dst = self.dst if self.dst is not None else src
            key: Any = (src, value.shape)
        else:
            dst = self.dst if self.dst is not None else src
            key = value.shape
        move = self._moves.get(key, _UNPLANNED)
        if move is _UNPLANNED:
            move = self.converter.move(value, src, dst, owned=self.owned)
            self._moves[key] = move
        if move is None:
            out = value
        else:
            out = move(value)
            if move.gathered_box is not None:
                # If this turns out to be the model's output, its backward can slice (see
                # _root_output_hook).
                setattr(out, _GATHERED_FROM_ATTR, (value, move.gathered_box))
        setattr(out, _PLACEMENT_ATTR, dst)
        return out


class _Edges:
    """A module's planned boundaries: positional and keyword inputs, outputs."""

    __slots__ = ("inputs", "inputs_move", "kwargs", "outputs")

    def __init__(
        self, plan: ShardingPlan, converter: BoundaryConverter, owned_output: bool
    ) -> None:
        self.inputs = tuple(
            None if b is None else _Edge(b, converter, owned=False) for b in plan.inputs
        )
        self.kwargs = {k: _Edge(b, converter, owned=False) for k, b in plan.kwarg_inputs.items()}
        # Inputs are only touched when one of them may convert (a pre-hook otherwise costs a
        # call per forward for nothing).
        self.inputs_move = any(_moves(b) for b in (*plan.inputs, *plan.kwarg_inputs.values()))
        outputs = plan.outputs
        self.outputs: _Edge | tuple[_Edge | None, ...] | None
        if outputs is None:
            self.outputs = None
        elif isinstance(outputs, Boundary):
            self.outputs = _Edge(outputs, converter, owned_output)
        else:
            # A tuple output's elements are fresh only if the tuple's are; claim nothing.
            self.outputs = tuple(
                None if b is None else _Edge(b, converter, owned=False) for b in outputs
            )

    def convert_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(args)
        for i, edge in enumerate(self.inputs[: len(args)]):
            if edge is not None and _is_tensor(args[i]):
                out[i] = edge(args[i])
        return tuple(out)

    def convert_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not self.kwargs:
            return kwargs
        edges = self.kwargs
        return {k: edges[k](v) if k in edges and _is_tensor(v) else v for k, v in kwargs.items()}

    def convert_output(self, value: Any) -> Any:
        edges = self.outputs
        if edges is None:
            return value
        if isinstance(edges, _Edge):
            return edges(value) if _is_tensor(value) else value
        if not isinstance(value, tuple | list) or len(value) != len(edges):
            raise TypeError(
                f"the plan gives {len(edges)} output boundaries but the module returned "
                f"{type(value).__name__}"
            )
        return rebuild_sequence(
            value,
            [
                e(v) if e is not None and _is_tensor(v) else v
                for v, e in zip(value, edges, strict=True)
            ],
        )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


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

    for planned_module in resolved.modules:
        name, plan = planned_module.name, planned_module.sharding
        module = root.get_submodule(name)
        check = _FirstInputCheck(name, plan) if isinstance(module, nn.Linear) else None
        if plan.replaces_forward:
            _install_production_forward(module, plan, axis_mesh, coordinate, converter, check)
            continue
        edges = _Edges(plan, converter, owned_output=False)
        if edges.inputs_move:
            if edges.kwargs:
                module.register_forward_pre_hook(_pre_hook_with_kwargs(edges), with_kwargs=True)
            else:
                module.register_forward_pre_hook(_pre_hook(edges))
        if check is not None:
            check.install(module)
        if edges.outputs is not None:
            module.register_forward_hook(_post_hook(edges))
    root.register_forward_hook(
        _root_output_hook(coordinate, f"the output of {type(root).__name__}")
    )
    install_grad_reductions(root)


class _FirstInputCheck:
    """On the first call, check that what arrives fits a Linear's local weight, so that a
    style that does not fit its neighbours fails as a plan error naming the module instead of a
    shape error deep inside a matmul; then it is spent (no cost in the steady state)."""

    __slots__ = ("done", "name", "style")

    def __init__(self, name: str, plan: ShardingPlan) -> None:
        self.name, self.style, self.done = name, plan.style, False

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.done = True
        x = args[0] if args else None
        weight = module.get_parameter("weight")
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] != weight.shape[-1]:
            raise PlanError(
                f"module {self.name!r} ({self.style}): its input arrives with {x.shape[-1]} "
                f"features on this rank but its local weight {tuple(weight.shape)} takes "
                f"{weight.shape[-1]}; the layout the plan gives this input does not "
                "match what the module before it hands on (e.g. a ColwiseParallel output "
                "feeding a module that is not RowwiseParallel)"
            )

    def install(self, module: nn.Module) -> None:
        """As a pre-hook after the input conversions, removing itself after the first call."""

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            handle.remove()
            self(module, args)

        handle = module.register_forward_pre_hook(hook)


def _pre_hook(edges: _Edges) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        return edges.convert_args(args)

    return hook


def _pre_hook_with_kwargs(edges: _Edges) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return edges.convert_args(args), edges.convert_kwargs(kwargs)

    return hook


def _post_hook(edges: _Edges) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return edges.convert_output(output)

    return hook


def _root_output_hook(coordinate: int, where: str) -> Callable[..., Any]:
    def adjoint(value: torch.Tensor) -> torch.Tensor:
        placement = _placement_of(value)
        if not isinstance(placement, Replicate) or not value.requires_grad:
            return value
        gathered = getattr(value, _GATHERED_FROM_ATTR, None)
        if gathered is not None:
            # Gathered shards whose gradient arrives whole on every rank: each rank's shard
            # gradient is its slice, with no collective (instead of a reduce-scatter of the
            # adjoint pieces).
            source, box = gathered
            sliced: torch.Tensor = _apply(_GatheredOutput)(source, value.detach(), box)
            return sliced
        out: torch.Tensor = _apply(_ExactToAdjoint)(value, coordinate == 0)
        return out

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return adjoint(output)
        # Every tensor the model hands out, wherever it sits (a loss inside a ModelOutput, a
        # dict of heads): one skipped would keep every rank's gradient and scale the
        # parameters' gradients by the axis size.
        return map_tensors(adjoint, output, where=where)

    return hook


def _install_production_forward(
    module: nn.Module,
    plan: ShardingPlan,
    axis_mesh: DeviceMesh,
    coordinate: int,
    converter: BoundaryConverter,
    check: _FirstInputCheck | None,
) -> None:
    """The style's forward, with the module's boundaries run inside it instead of in hooks:
    the module's own call then takes torch's hook-free path, and where the style's forward
    returns a fresh tensor the output conversion may reduce it in place."""
    style = plan.behaviour
    forward = (
        None if style is None else style.production_forward(module, plan, axis_mesh, coordinate)
    )
    if forward is None or style is None:
        raise NotImplementedError(
            f"{plan.style} replaces the forward of {type(module).__name__} in production mode, "
            "but gives no production forward for it"
        )
    edges = _Edges(plan, converter, owned_output=style.production_output_is_fresh(module))
    inner: Callable[..., Any] = forward
    inputs_move = edges.inputs_move

    def planned_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if inputs_move:
            args, kwargs = edges.convert_args(args), edges.convert_kwargs(kwargs)
        if check is not None and not check.done:
            check(self, args)
        return edges.convert_output(inner(self, *args, **kwargs))

    object.__setattr__(module, "forward", types.MethodType(planned_forward, module))
