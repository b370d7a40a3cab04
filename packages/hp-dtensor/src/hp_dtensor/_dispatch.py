"""Op dispatch for DTensor: rule lookup, cached decisions, redistribution, local call, wrapping.

The first call of an op with given input layouts and non-tensor arguments asks the op's
sharding rule and *prepares* the call: the redistribution plan of every input, the template
of the local call, and the output layouts with this rank's expected local shapes. The
prepared call is cached (rules are pure), so later calls with the same layouts only run the
planned redistributions, the local op, and the output wrapping.

Plain tensors among DTensors. A 0-d tensor is a scalar: it reaches the local call as it is,
on every rank. Any other plain tensor is an error (its layout would be guessed), except where
plain tensors are *implicitly replicated*: inside :func:`implicit_replication`, and on a mesh
:func:`replicate_plain_tensors_on` marked (validation mode marks the mesh of the model it
converts, so the loss a production script computes outside the model against plain targets
runs unchanged). Such a tensor is taken as the same value on every rank: a ``Replicate``
DTensor over the mesh whose local tensor is the tensor itself.

Gradient of a plain tensor (or 0-d scalar) that requires grad: it is one value, the same on
every rank (as :meth:`DTensor.full_tensor`'s result is), so its ``.grad`` is the true gradient
on every rank, as ``torch.distributed.tensor`` gives it, never a per-rank share and never
mesh-size times it. Inside, the DTensor's local gradient is in the dual layout (a
``Partial(sum)`` contribution per rank); the tensor enters through an identity whose backward
all-reduces that contribution over every mesh axis (one all-reduce per use).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from hp_dtensor._routing import install_dispatch
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor, as_one_value
from hp_dtensor.redistribute import execute_plan, plan_for
from hp_dtensor.rules.registry import (
    OpCall,
    ReplicatedResult,
    ShardingDecision,
    ShardingRuleError,
    canonical_name,
    rule_for,
)
from hp_layout import Layout, RedistributePlan, Replicate

__all__ = ["dispatch", "implicit_replication", "replicate_plain_tensors_on"]

_CACHE_SIZE = 8192


class _Slot:
    """Where a DTensor's local tensor goes in a local-call template."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<slot>"


SLOT = _Slot()


class _UncacheableError(Exception):
    """The call has arguments that cannot key the cache (plain tensors, unhashables)."""


def _key(value: Any, dtensors: list[DTensor]) -> Any:
    """The cache key of one argument; DTensors are collected in order."""
    if isinstance(value, DTensor):
        dtensors.append(value)
        return value._dist_layout
    if isinstance(value, tuple | list):
        return (type(value), tuple([_key(v, dtensors) for v in value]))
    if isinstance(value, torch.Tensor):
        raise _UncacheableError
    if isinstance(value, slice):  # unhashable before Python 3.12
        return (slice, value.start, value.stop, value.step)
    hash(value)
    return (type(value), value)


def _rule_arg(value: Any) -> Any:
    """The argument as a rule sees it: every DTensor replaced by its layout."""
    if isinstance(value, DTensor):
        return value._dist_layout
    if isinstance(value, tuple | list) and not _is_namedtuple(value):
        return type(value)(_rule_arg(v) for v in value)
    return value


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _template(value: Any) -> Any:
    """The local-call template: every Layout (a DTensor's place) becomes a SLOT."""
    if isinstance(value, Layout):
        return SLOT
    if isinstance(value, tuple | list) and not _is_namedtuple(value):
        return type(value)(_template(v) for v in value)
    if isinstance(value, dict):
        return {k: _template(v) for k, v in value.items()}
    return value


def _fill(template: Any, locals_: list[torch.Tensor], position: list[int]) -> Any:
    if template is SLOT:
        value = locals_[position[0]]
        position[0] += 1
        return value
    if isinstance(template, tuple | list) and not _is_namedtuple(template):
        return type(template)(_fill(v, locals_, position) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, locals_, position) for k, v in template.items()}
    return template


@dataclass(frozen=True)
class _Prepared:
    """A decided call, ready to run on any later call with the same key."""

    plans: tuple[RedistributePlan | None, ...]
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    flat_outputs: tuple[Layout | ReplicatedResult | None, ...]
    local_shapes: tuple[tuple[int, ...] | None, ...]
    inplace_self: bool
    describe: str
    flat_slots: tuple[int, ...] | None


_PREPARED: OrderedDict[Any, _Prepared] = OrderedDict()

# Depth of active implicit_replication() contexts.
_IMPLICIT_REPLICATION = [0]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this context, a plain tensor that meets DTensors in an op is taken as replicated
    on their mesh (as in ``torch.distributed.tensor.experimental.implicit_replication``).

    Model code creates tensors of its own (position ids from ``arange``, causal masks, rotary
    tables) and mixes them with its activations; outside this context (and off the meshes
    :func:`replicate_plain_tensors_on` marked) that is an error, so a tensor whose layout
    matters is never guessed. A replicated plain tensor that requires grad gets the true
    gradient on every rank (see the module docstring).
    """
    _IMPLICIT_REPLICATION[0] += 1
    try:
        yield
    finally:
        _IMPLICIT_REPLICATION[0] -= 1


# Set on a DeviceMesh object (its own private state) by replicate_plain_tensors_on.
_MESH_REPLICATES_PLAIN = "_hp_dtensor_replicates_plain_tensors"


def replicate_plain_tensors_on(mesh: DeviceMesh) -> None:
    """From now on, a plain tensor that meets DTensors on ``mesh`` (this object, and the
    DTensors ops derive from them) is taken as replicated, as inside
    :func:`implicit_replication`.

    Validation mode calls it for the mesh of the model it converts: a production script
    mixes the model's outputs with plain tensors of its own (targets, masks, class weights),
    which production mode runs as the same value on every rank.
    """
    setattr(mesh, _MESH_REPLICATES_PLAIN, True)


def _replicates_plain(mesh: DeviceMesh) -> bool:
    return bool(_IMPLICIT_REPLICATION[0]) or getattr(mesh, _MESH_REPLICATES_PLAIN, False)


OpObserver = Callable[
    [Callable[..., Any], tuple[Any, ...], dict[str, Any], Sequence[DTensor], "_Prepared", Any],
    None,
]
OBSERVERS: list[OpObserver] = []
"""Called after every dispatched op as ``observer(func, args, kwargs, dtensors, prepared,
result)`` (validation mode checks ops with it). Empty in normal use: no cost."""


def _prepare(call: OpCall, decision: ShardingDecision, dtensors: Sequence[DTensor]) -> _Prepared:
    if len(decision.inputs) != len(dtensors):
        raise ShardingRuleError(
            f"the rule for {call.describe()} gave {len(decision.inputs)} input layouts for "
            f"{len(dtensors)} DTensor inputs"
        )
    plans = tuple(
        None if wanted == t._dist_layout else plan_for(t._dist_layout, wanted)
        for t, wanted in zip(dtensors, decision.inputs, strict=True)
    )
    inplace_self = call.inplace and bool(call.args) and isinstance(call.args[0], Layout)
    if inplace_self:
        if plans[0] is not None:
            raise ShardingRuleError(
                f"in-place {call.name} cannot change the layout of its self argument from "
                f"{dtensors[0]._dist_layout!r} to {decision.inputs[0]!r}"
            )
        if decision.outputs != dtensors[0]._dist_layout:
            raise ShardingRuleError(
                f"in-place {call.name} would change {dtensors[0]._dist_layout!r} into "
                f"{decision.outputs!r}; use the out-of-place op"
            )
    local_args = decision.local_args if decision.local_args is not None else call.args
    local_kwargs = decision.local_kwargs if decision.local_kwargs is not None else call.kwargs
    args_template = _template(tuple(local_args))
    kwargs_template = _template(dict(local_kwargs))
    slots = [0]
    _count_slots((args_template, kwargs_template), slots)
    if slots[0] != len(dtensors):
        raise ShardingRuleError(
            f"the rule for {call.describe()} left {slots[0]} tensor places in the local call "
            f"for {len(dtensors)} DTensor inputs"
        )
    flat_outputs, _ = tree_flatten(
        decision.outputs,
        is_leaf=lambda x: isinstance(x, Layout | ReplicatedResult) or x is None,
    )
    shapes = tuple(
        layout.local_shape(call.rank) if isinstance(layout, Layout) else None
        for layout in flat_outputs
    )
    return _Prepared(
        plans,
        decision.local_func or call.func,
        args_template,
        kwargs_template,
        decision.outputs,
        tuple(flat_outputs),
        shapes,
        inplace_self,
        call.describe(),
        _flat_slots(args_template, kwargs_template),
    )


def _flat_slots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """Positions of the slots when they all sit at the top level of ``args``, else None."""
    nested = [0]
    _count_slots((tuple(v for v in args if v is not SLOT), kwargs), nested)
    if nested[0]:
        return None
    return tuple(i for i, v in enumerate(args) if v is SLOT)


def _count_slots(template: Any, count: list[int]) -> None:
    if template is SLOT:
        count[0] += 1
    elif isinstance(template, tuple | list):
        for v in template:
            _count_slots(v, count)
    elif isinstance(template, dict):
        for v in template.values():
            _count_slots(v, count)


def _wrap(out: Any, prepared: _Prepared, mesh: DeviceMesh) -> Any:
    if isinstance(out, torch.Tensor) and len(prepared.flat_outputs) == 1:
        return _wrap_one(out, prepared.flat_outputs[0], prepared.local_shapes[0], prepared, mesh)
    flat_out, spec = tree_flatten(out)
    if len(flat_out) != len(prepared.flat_outputs):
        raise ShardingRuleError(
            f"the rule for {prepared.describe} gave {len(prepared.flat_outputs)} output layouts "
            f"for {len(flat_out)} outputs"
        )
    wrapped = [
        _wrap_one(value, layout, shape, prepared, mesh)
        if isinstance(value, torch.Tensor)
        else value
        for value, layout, shape in zip(
            flat_out, prepared.flat_outputs, prepared.local_shapes, strict=True
        )
    ]
    return tree_unflatten(wrapped, spec)


def _wrap_one(
    value: torch.Tensor,
    layout: Layout | ReplicatedResult | None,
    shape: tuple[int, ...] | None,
    prepared: _Prepared,
    mesh: DeviceMesh,
) -> DTensor:
    if layout is None:
        raise ShardingRuleError(
            f"the rule for {prepared.describe} gave no layout for a tensor output"
        )
    if isinstance(layout, ReplicatedResult):
        # Every rank computed the whole result from replicated inputs: its shape is global.
        whole = Layout(tuple(value.shape), layout.mesh, [Replicate()] * layout.mesh.ndim)
        return DTensor(value, whole, mesh)
    if tuple(value.shape) != shape:
        raise ShardingRuleError(
            f"the rule for {prepared.describe} promised {layout!r} (local shape {shape} on "
            f"rank {mesh.get_rank()}) but the local op returned shape {tuple(value.shape)}"
        )
    return DTensor(value, layout, mesh)


def _run(prepared: _Prepared, dtensors: Sequence[DTensor], mesh: DeviceMesh) -> Any:
    locals_ = [
        t._local if plan is None else execute_plan(t._local, plan, mesh)
        for t, plan in zip(dtensors, prepared.plans, strict=True)
    ]
    if prepared.flat_slots is not None:
        args_list = list(prepared.args)
        for index, local in zip(prepared.flat_slots, locals_, strict=True):
            args_list[index] = local
        args: Any = args_list
        kwargs: Any = prepared.kwargs
    else:
        position = [0]
        args = _fill(prepared.args, locals_, position)
        kwargs = _fill(prepared.kwargs, locals_, position)
    with DisableTorchFunctionSubclass():
        out = prepared.func(*args, **kwargs)
    if prepared.inplace_self:
        return dtensors[0]
    return _wrap(out, prepared, mesh)


def _mesh_of(dtensors: Sequence[DTensor], name: str) -> DeviceMesh:
    mesh = dtensors[0]._device_mesh
    for t in dtensors[1:]:
        if t._device_mesh is not mesh and t._device_mesh != mesh:
            raise ValueError(
                f"{name}: DTensors on different meshes ({mesh!r} and {t._device_mesh!r}); "
                "redistribute them onto one mesh first"
            )
    return mesh


def _decide(func: Callable[..., Any], call: OpCall) -> ShardingDecision:
    rule = rule_for(func)
    if rule is None:
        layouts = ", ".join(repr(x) for x in call.layouts)
        raise ShardingRuleError(
            f"no sharding rule for {getattr(func, '__qualname__', func)!r} (called as "
            f"{call.name!r}) with input layouts [{layouts}]; register one with "
            "hp_dtensor.register_sharding_rule"
        )
    return rule(call)


def dispatch(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on DTensor arguments through its sharding rule."""
    dtensors: list[DTensor] = []
    try:
        key: Any = (
            func,
            _key(args, dtensors),
            _key(tuple(kwargs.items()), dtensors) if kwargs else None,
        )
        prepared = _PREPARED.get(key)
    except (_UncacheableError, TypeError):
        return _dispatch_uncached(func, args, kwargs)
    mesh = _mesh_of(dtensors, getattr(func, "__name__", "op"))
    if prepared is None:
        name, inplace = canonical_name(func)
        rule_args = tuple(_rule_arg(a) for a in args)
        rule_kwargs = {k: _rule_arg(v) for k, v in kwargs.items()}
        call = OpCall(func, name, rule_args, rule_kwargs, mesh.get_rank(), inplace)
        prepared = _prepare(call, _decide(func, call), dtensors)
        _PREPARED[key] = prepared
        if len(_PREPARED) > _CACHE_SIZE:
            _PREPARED.popitem(last=False)
    result = _run(prepared, dtensors, mesh)
    for observer in OBSERVERS:
        observer(func, args, kwargs, dtensors, prepared, result)
    return result


def _replicate_plain(flat: list[Any], mesh: DeviceMesh) -> list[Any]:
    """Plain tensors (not 0-d scalars) among DTensors, wrapped as replicated on their mesh."""
    replicated = [Replicate()] * mesh.ndim
    return [
        DTensor(as_one_value(v, mesh), Layout(tuple(v.shape), mesh.mesh, replicated), mesh)
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
        else v
        for v in flat
    ]


def _plain_scalars(flat: list[Any], mesh: DeviceMesh) -> list[Any]:
    """0-d plain tensors that require grad, made one value (see the module docstring)."""
    return [
        as_one_value(v, mesh)
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() == 0
        else v
        for v in flat
    ]


def _dispatch_uncached(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The general path: any pytree of arguments, 0-d plain tensors as scalars."""
    flat, spec = tree_flatten((args, kwargs))
    name, inplace = canonical_name(func)
    first = next((v for v in flat if isinstance(v, DTensor)), None)
    replicated: list[tuple[int, ...]] = []  # shapes of plain tensors taken as replicated
    if first is not None:
        if _replicates_plain(first._device_mesh):
            replicated = [
                tuple(v.shape)
                for v in flat
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0
            ]
            flat = _replicate_plain(flat, first._device_mesh)
        flat = _plain_scalars(flat, first._device_mesh)
    dtensors: list[DTensor] = []
    placeholders: list[Any] = []
    plain: list[torch.Tensor] = []
    for value in flat:
        if isinstance(value, DTensor):
            dtensors.append(value)
            placeholders.append(value._dist_layout)
        elif isinstance(value, torch.Tensor):
            if value.dim() > 0:
                # Not a TypeError: torch turns TypeErrors of binary operators into
                # NotImplemented and the message would be lost.
                raise ShardingRuleError(
                    f"{name}: got a torch.Tensor of shape {tuple(value.shape)} together with "
                    "DTensors; make it a DTensor (distribute_tensor or DTensor.from_local) so "
                    "its layout is explicit, or take it as replicated on every rank inside "
                    "hp_dtensor.implicit_replication()"
                )
            plain.append(value)
            placeholders.append(value)
        else:
            placeholders.append(value)
    mesh = _mesh_of(dtensors, name)
    call_args, call_kwargs = tree_unflatten(placeholders, spec)
    call = OpCall(func, name, tuple(call_args), call_kwargs, mesh.get_rank(), inplace)
    try:
        decision = _decide(func, call)
    except (ShardingRuleError, RuntimeError) as exc:
        if not replicated or type(exc) not in (ShardingRuleError, RuntimeError):
            raise
        # The likely cause: a rank-local piece (a data-parallel rank's batch of targets)
        # taken as the whole value.
        raise type(exc)(
            f"{exc} (plain tensors of shapes {replicated} were taken as replicated: the whole "
            "value, the same on every rank; give a rank-local piece, such as a data-parallel "
            "rank's batch, as DTensor.from_local(tensor, mesh, placements))"
        ) from exc
    prepared = _prepare(call, decision, dtensors)
    result = _run(prepared, dtensors, mesh)
    for observer in OBSERVERS:
        observer(func, args, kwargs, dtensors, prepared, result)
    return result


install_dispatch(dispatch)
