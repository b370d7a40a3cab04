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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.interop import annotate_layout
from hp_dtensor.parallel import context_attention
from hp_dtensor.parallel._boundary import BoundaryConverter
from hp_dtensor.parallel._grad_reduction import install_grad_reductions, set_grad_reduction
from hp_dtensor.parallel._structure import map_tensors, rebuild_sequence
from hp_dtensor.parallel.context_plan import ContextParallelPlan
from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan
from hp_dtensor.redistribute import execute_plan
from hp_layout import Layout, Placement, ReduceOp, Replicate, Shard, StepKind

__all__ = ["apply_production"]

# Tensors handed on by a boundary carry their placement on the parallel axis in this attribute
# (the root output hook reads it).
_PLACEMENT_ATTR = "_hp_boundary_placement"


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


_GATHERED_FROM_ATTR = "_hp_gathered_from"


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


def _rowwise_linear_forward(coordinate: int) -> Callable[..., torch.Tensor]:
    # Every rank's local product is a partial sum; the bias must be counted once. The other
    # ranks still add it times zero: their (zero) bias gradient then arrives too, so every rank
    # reduces the same gradient bucket in backward (a rank without it would leave the others'
    # reduction without a partner).
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias: torch.Tensor | None = self.bias
        if bias is not None and coordinate != 0:
            bias = bias * 0.0
        return F.linear(x, self.weight, bias)

    return forward


def _vocab_parallel_embedding_forward(start: int, stop: int) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= stop)
        local_ids = torch.where(outside, torch.zeros_like(ids), ids - start)
        padding = self.padding_idx
        local_padding = padding - start if padding is not None and start <= padding < stop else None
        if stop == start:
            # An empty vocabulary shard contributes zeros (still connected to the weight).
            shape = (*ids.shape, self.weight.shape[1])
            return self.weight.sum() * 0 + torch.zeros(shape, dtype=self.weight.dtype)
        out = F.embedding(local_ids, self.weight, local_padding, None, 2.0, False, False)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    return forward


def apply_production(
    root: nn.Module,
    mesh: DeviceMesh,
    axis: str,
    dp_axes: Sequence[str],
    lowered: Sequence[tuple[str, ShardingPlan]],
    placements: dict[int, tuple[Placement, ...]],
) -> None:
    """Convert ``root`` in place for production mode (see the module docstring)."""
    rank = mesh.get_rank()
    axis_mesh = mesh[axis]
    converter = BoundaryConverter(axis_mesh)
    coordinate = mesh.get_local_rank(axis)
    done: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in done:
                setattr(module, name, done[id(param)])
                continue
            full = placements.get(id(param), (Replicate(),) * mesh.ndim)
            layout = Layout(tuple(param.shape), mesh.mesh, full)
            local = _local_param(param, layout, rank)
            reductions = [
                (ax, ReduceOp.SUM if ax == axis else ReduceOp.AVG)
                for ax, p in zip(mesh.mesh_dim_names, full, strict=True)
                if isinstance(p, Replicate) and mesh.size(ax) > 1 and (ax == axis or ax in dp_axes)
            ]
            if reductions:
                set_grad_reduction(local, mesh, reductions)
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

    for name, plan in lowered:
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
    forward: Callable[..., Any] | None = None
    if plan.style == "RowwiseParallel" and isinstance(module, nn.Linear):
        forward = _rowwise_linear_forward(coordinate)
    elif plan.style == "RowwiseParallel" and isinstance(module, nn.Embedding):
        layout = Layout((module.num_embeddings, module.embedding_dim), axis_mesh.mesh, [Shard(0)])
        (start, stop), _ = layout.local_region(axis_mesh.get_rank()).box
        forward = _vocab_parallel_embedding_forward(start, stop)
    elif plan.style == "SequenceParallel" and isinstance(module, nn.modules.dropout._DropoutNd):
        forward = _sequence_parallel_dropout_forward(axis_mesh, plan)
    elif isinstance(plan, ContextParallelPlan):
        forward = context_attention.production_forward(module, plan, axis_mesh)
    elif plan.style in ("ExpertParallel", "ExpertTensorParallel"):
        from hp_dtensor.parallel.expert import expert_parallel_forward

        forward = expert_parallel_forward(module, axis_mesh)
    if forward is None:
        raise NotImplementedError(
            f"{plan.style} replaces the forward of {type(module).__name__} in production mode, "
            "but no production forward exists for it"
        )
    object.__setattr__(module, "forward", types.MethodType(forward, module))


def _sequence_parallel_dropout_forward(
    axis_mesh: DeviceMesh, plan: ShardingPlan
) -> Callable[..., torch.Tensor]:
    from hp_dtensor.parallel import random as parallel_random

    boundary = plan.inputs[0]
    assert boundary is not None
    placement = boundary.target
    converter = BoundaryConverter(axis_mesh)

    def forward(self: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = converter.global_shape(x, placement or Replicate())
        layout = Layout(shape, axis_mesh.mesh, [placement or Replicate()])
        return parallel_random.parallel_dropout_forward(self, x, layout, axis_mesh.get_rank())

    return forward
