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

A torch DTensor a caller of torch's tensor parallelism hands a planned module is taken as
torch's styles take it (its own placement redistributed to what the module needs, then its
local shard), by a pre-hook that runs before every other, so the model's edge sees a plain
local tensor with its placement.

Gradient conventions: inside the model the local gradients are the true per-rank adjoints, so a
replicated value's gradient is a partial contribution. The caller computes the loss on every
rank and calls ``loss.backward()`` with the gradient 1 everywhere: its tensors carry the whole
gradient. The model's edge (:mod:`hp_dtensor.parallel._region`) converts between the two
wherever the caller calls one of the model's modules, and marks replicated parameters' uses
inside the model so that only their partial gradients are reduced: summed over the parallel
axis, averaged over data-parallel axes (each data-parallel rank's loss is the mean over its own
batch, as in DDP).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

import hp_dtensor._comm as _comm
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.interop import (
    annotate_layout,
    is_torch_dtensor,
    placement_from_torch,
    torch_placement,
)
from hp_dtensor.parallel._boundary import BoundaryConverter, Move
from hp_dtensor.parallel._grad_reduction import (
    bucket_of,
    grad_region_of,
    install_grad_reductions,
    set_grad_reduction,
    set_grad_region,
)
from hp_dtensor.parallel._region import (
    GATHERED_FROM_ATTR,
    REGION_ATTR,
    ModuleEdge,
    Region,
    placement_of,
    sequence_sharded,
    set_placement,
)
from hp_dtensor.parallel._structure import rebuild_sequence
from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan
from hp_dtensor.parallel.resolved import ParallelPlan
from hp_layout import Layout, Placement, Replicate

__all__ = ["apply_production"]


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
            if self.dst is not None:
                set_placement(value, self.dst)
            return value
        src = self.src
        if src is None:
            # Whatever arrives: its placement is part of the key.
            src = placement_of(value) or Replicate()
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
                # Handed to the caller, its backward can slice (see _region).
                setattr(out, GATHERED_FROM_ATTR, (value, move.gathered_box))
        set_placement(out, dst)
        return out


class _Edges:
    """A module's planned boundaries: positional and keyword inputs, outputs."""

    __slots__ = ("exact_inputs", "inputs", "inputs_move", "kwargs", "outputs")

    def __init__(
        self, plan: ShardingPlan, converter: BoundaryConverter, owned_output: bool
    ) -> None:
        self.inputs = tuple(
            None if b is None else _Edge(b, converter, owned=False) for b in plan.inputs
        )
        self.kwargs = {k: _Edge(b, converter, owned=False) for k, b in plan.kwarg_inputs.items()}
        self.exact_inputs = plan.exact_inputs
        # Inputs are only converted when one of them may move or their number is checked;
        # otherwise only a torch DTensor the caller hands in is taken apart (see
        # _torch_inputs_hook).
        self.inputs_move = plan.exact_inputs or any(
            _moves(b) for b in (*plan.inputs, *plan.kwarg_inputs.values())
        )
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

    def check_count(self, args: tuple[Any, ...]) -> None:
        """Refuse a call with another number of positional inputs than the plan gives
        layouts for, where the plan says so (torch's ``PrepareModuleInput``: ``ValueError``)."""
        if self.exact_inputs and len(args) != len(self.inputs):
            raise ValueError(
                f"module inputs and input_layouts should have same length: the module got "
                f"{len(args)} positional inputs but its plan gives {len(self.inputs)} input "
                "layouts (one per positional input, None to leave one alone)"
            )

    def convert_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.check_count(args)
        out = list(args)
        for i, edge in enumerate(self.inputs[: len(args)]):
            if edge is not None and _is_tensor(args[i]):
                out[i] = _arrive(edge, args[i])
        return tuple(out)

    def convert_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not self.kwargs:
            return kwargs
        edges = self.kwargs
        return {
            k: _arrive(edges[k], v) if k in edges and _is_tensor(v) else v
            for k, v in kwargs.items()
        }

    def convert_output(self, value: Any) -> Any:
        edges = self.outputs
        if edges is None:
            return value
        if isinstance(edges, _Edge):
            return edges(value) if _is_tensor(value) else value
        if not isinstance(value, tuple | list) or len(value) != len(edges):
            # torch's PrepareModuleOutput refuses this with a ValueError too.
            got = f"{len(value)} outputs" if isinstance(value, tuple | list) else "one output"
            raise ValueError(
                f"module outputs and output_layouts should have same length: the plan gives "
                f"{len(edges)} output boundaries but the module returned {got} "
                f"({type(value).__name__})"
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


def _arrive(edge: _Edge, value: torch.Tensor) -> torch.Tensor:
    """``value`` through an input boundary (a torch DTensor was taken apart before, by
    :func:`_torch_inputs_hook`)."""
    return edge(value)


def _local_of_torch_dtensor(
    value: Any, target: Placement | None, partial_grads: bool
) -> torch.Tensor:
    """This rank's shard of a torch DTensor on the parallel axis, laid out as ``target``
    (None: as it is), with its placement recorded. ``partial_grads``: a replicated shard's
    gradient stays this rank's partial contribution (no model edge sums it), so torch is told
    so; with the edge (:mod:`hp_dtensor.parallel._region`) it arrives whole."""
    from torch.distributed.tensor import Partial as TorchPartial

    if value.device_mesh.ndim != 1:
        raise PlanError(
            f"a torch DTensor on a {value.device_mesh.ndim}-d mesh was handed to a module of a "
            "production-mode plan; hand it its local shard (to_local()) or a DTensor on the "
            "1-d tensor-parallel mesh"
        )
    if target is not None:
        wanted = (torch_placement(target),)
        if tuple(value.placements) != wanted:
            value = value.redistribute(placements=wanted)
    placement = placement_from_torch(value.placements[0])
    grads = (TorchPartial(),) if partial_grads and isinstance(placement, Replicate) else None
    local = cast(torch.Tensor, value.to_local(grad_placements=grads))
    set_placement(local, placement)
    return local


def _torch_inputs_hook(edges: _Edges, partial_grads: bool) -> Callable[..., Any]:
    """Take apart the torch DTensors a caller of torch's tensor parallelism hands a module with
    input boundaries, as torch's styles take them: the DTensor's own placement is what
    arrives, redistributed to what the module needs, then its local shard. Runs before every
    other pre-hook (the model's edge then sees the local shard and its placement); plain
    tensors pass untouched (one type test each)."""
    positional = edges.inputs
    keyword = edges.kwargs

    def take(edge: _Edge | None, value: Any) -> Any:
        if edge is None or type(value) is torch.Tensor or not is_torch_dtensor(value):
            return value
        return _local_of_torch_dtensor(value, edge.dst, partial_grads)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (
            _has_torch_dtensor(args) or (kwargs and _has_torch_dtensor(tuple(kwargs.values())))
        ):
            return None
        edges.check_count(args)
        taken = tuple(
            take(positional[i] if i < len(positional) else None, a) for i, a in enumerate(args)
        )
        return taken, {k: take(keyword.get(k), v) for k, v in kwargs.items()}

    return hook


def _has_torch_dtensor(values: tuple[Any, ...]) -> bool:
    # Activations are exact torch.Tensors: one type test each.
    return any(type(value) is not torch.Tensor and is_torch_dtensor(value) for value in values)


def apply_production(root: nn.Module, mesh: DeviceMesh, resolved: ParallelPlan) -> None:
    """Convert ``root`` in place for production mode (see the module docstring), as the
    resolved plan says."""
    rank = mesh.get_rank()
    axis = resolved.tp_axis
    axis_mesh = mesh[axis]
    converter = BoundaryConverter(axis_mesh)
    coordinate = mesh.get_local_rank(axis)
    region = _region_of(root, mesh, resolved)
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
                if region is not None:
                    set_grad_region(local, region.token)
            done[id(param)] = local
            setattr(module, name, local)

    torch_inputs: list[tuple[nn.Module, _Edges]] = []
    for planned_module in resolved.modules:
        name, plan = planned_module.name, planned_module.sharding
        module = root.get_submodule(name)
        if plan.behaviour is not None:
            plan.behaviour.prepare_production(module, axis_mesh)
        check = _FirstInputCheck(name, plan) if isinstance(module, nn.Linear) else None
        if plan.replaces_forward:
            edges = _install_production_forward(
                module, plan, axis_mesh, coordinate, converter, check
            )
            if edges.inputs or edges.kwargs:
                torch_inputs.append((module, edges))
            continue
        edges = _Edges(plan, converter, owned_output=False)
        if edges.inputs_move:
            if edges.kwargs:
                module.register_forward_pre_hook(_pre_hook_with_kwargs(edges), with_kwargs=True)
            else:
                module.register_forward_pre_hook(_pre_hook(edges))
        if edges.inputs or edges.kwargs:
            torch_inputs.append((module, edges))
        if check is not None:
            check.install(module)
        if edges.outputs is not None:
            module.register_forward_hook(_post_hook(edges))
    if region is None:
        install_grad_reductions(root)
    else:
        _install_region(root, resolved, region)
        object.__setattr__(root, REGION_ATTR, region)
    # Installed last and first in line: torch DTensors are taken apart before the model's edge
    # and the boundaries see the arguments.
    for module, edges in torch_inputs:
        module.register_forward_pre_hook(
            _torch_inputs_hook(edges, partial_grads=region is None), prepend=True, with_kwargs=True
        )


def _region_of(root: nn.Module, mesh: DeviceMesh, resolved: ParallelPlan) -> Region | None:
    """The model's region (:mod:`hp_dtensor.parallel._region`), or None where each rank's
    caller computes a loss of its own over the axis (expert parallelism)."""
    if any(m.sharding.per_rank_loss() for m in resolved.modules):
        return None
    # What crosses between modules: inputs as they arrive, outputs as they are handed on.
    placements: list[Placement | None] = []
    for m in resolved.modules:
        plan = m.sharding
        placements += [b.layout for b in (*plan.inputs, *plan.kwarg_inputs.values()) if b]
        outputs = plan.outputs
        for b in outputs if isinstance(outputs, tuple) else (outputs,):
            if b is not None:
                placements.append(b.target)
    group = _comm.AxisGroup.of(mesh, resolved.tp_axis)
    return Region(root, group, bucket_of(root), sequence_sharded(placements))


def _install_region(root: nn.Module, resolved: ParallelPlan, region: Region) -> None:
    """Track the calls of the root, of every planned module and of every module holding
    parameters: any of them the caller may call itself."""
    planned = {m.name: m.sharding for m in resolved.modules}
    for prefix, module in root.named_modules():
        plan = planned.get(prefix)
        if module is not root and plan is None and next(module.parameters(), None) is None:
            continue
        reduced = tuple(
            (path, n)
            for path, owner in module.named_modules()
            for n, p in owner.named_parameters(recurse=False)
            if grad_region_of(p) == region.token
        )
        own = tuple(name for path, name in reduced if not path)
        edge = ModuleEdge(prefix, params=reduced, own=own)
        if plan is not None:
            edge.inputs = tuple(None if b is None else b.layout for b in plan.inputs)
            edge.kwargs = {k: b.layout for k, b in plan.kwarg_inputs.items()}
        region.install(module, edge)


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
        weight = cast(torch.Tensor, module.weight)
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


def _install_production_forward(
    module: nn.Module,
    plan: ShardingPlan,
    axis_mesh: DeviceMesh,
    coordinate: int,
    converter: BoundaryConverter,
    check: _FirstInputCheck | None,
) -> _Edges:
    """The style's forward, with the module's boundaries run inside it instead of in hooks:
    the module's own call then takes torch's hook-free path, and where the style's forward
    returns a fresh tensor the output conversion may reduce it in place. Returns the
    module's boundaries."""
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
    return edges
