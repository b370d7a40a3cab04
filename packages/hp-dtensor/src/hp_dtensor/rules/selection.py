"""Sharding rules for the selections of a mixture-of-experts router: ``topk``, ``sort`` /
``argsort``, ``one_hot``, ``histc``, ``nonzero`` / ``argwhere`` and one-argument
``torch.where``.

* ``topk(k, dim)``, ``sort(dim)``, ``argsort(dim)``: the dim the selection runs along is made
  ``Replicate`` (every row's candidates on every rank, so ties break as on one device), other
  dims keep their shards; values and indices share the layout. Partial inputs are reduced (a
  selection is not linear).
* ``histc(bins, min, max)``: counts are additive, so a sharded input is counted locally and
  the result is ``Partial(sum)`` over the axes that shard it. With ``min == max`` the range is
  the data's own, which every shard would find differently: such a call needs a fully
  replicated input and is refused otherwise.
* ``one_hot(num_classes)``: the new class dim is whole on every rank; the input's shards stay.
  Without ``num_classes`` the class count is the largest value plus one: a fully replicated
  input gives a replicated result of the shape the local call finds; a sharded one is refused
  (every rank would find its own count).
* ``nonzero`` / ``argwhere`` / ``torch.where(condition)``: the result's shape depends on the
  values, so the input must be fully replicated (Partial is reduced first); the result is
  replicated with the shape the local call finds. A sharded input is refused: its positions
  are global, and every rank would find its own count.

The three-argument ``torch.where(condition, input, other)`` is element-wise
(:func:`.pointwise.pointwise_decision`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hp_dtensor.rules._common import (
    normalize_dim,
    replicate_axes_where,
    unshard_dims,
    with_placements,
)
from hp_dtensor.rules.pointwise import NONLINEAR, pointwise_decision
from hp_dtensor.rules.registry import (
    OpCall,
    ReplicatedResult,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__: list[str] = []


def _only(call: OpCall) -> Layout:
    """The one DTensor argument, which must be the first."""
    layouts = call.layouts
    if len(layouts) != 1 or not call.args or call.args[0] is not layouts[0]:
        raise ShardingRuleError(
            f"{call.describe()}: only the first argument may be a DTensor; pass the other "
            "arguments as Python values"
        )
    layout: Layout = layouts[0]
    return layout


def _int_arg(value: Any, op: str, what: str) -> int:
    if isinstance(value, Layout | torch.Tensor):
        raise ShardingRuleError(f"{op}: {what} must be a Python int, got a tensor")
    return int(value)


@register_sharding_rule(torch.topk, torch.Tensor.topk)
def _topk(call: OpCall) -> ShardingDecision:
    """``topk(k, dim=-1, largest, sorted)``: see the module docstring."""
    layout = _only(call)
    k = _int_arg(call.arg(1, "k"), call.name, "k")
    given = call.arg(2, "dim", None)
    dim = normalize_dim(-1 if given is None else int(given), layout.ndim, call.name)
    target = _along_dim(layout, dim)
    if layout.ndim and not 0 <= k <= layout.global_shape[dim]:
        raise RuntimeError(
            f"topk: k ({k}) is out of range for dim {dim} of size {layout.global_shape[dim]}"
        )
    shape = list(layout.global_shape)
    if layout.ndim:
        shape[dim] = k
    out = with_placements(target, target.placements, shape)
    return ShardingDecision((target,), (out, out))


def _along_dim(layout: Layout, dim: int) -> Layout:
    """``layout`` with ``dim`` whole on every rank and Partial reduced."""
    return replicate_axes_where(unshard_dims(layout, [dim] if layout.ndim else []))


def _sort_dim(call: OpCall, layout: Layout) -> int:
    given = call.arg(1, "dim", -1)
    if isinstance(given, bool):  # sort(stable) is keyword-only; a bool here is a mistake
        raise ShardingRuleError(f"{call.describe()}: dim must be an int")
    return normalize_dim(-1 if given is None else int(given), layout.ndim, call.name)


@register_sharding_rule(torch.sort, torch.Tensor.sort)
def _sort(call: OpCall) -> ShardingDecision:
    """``sort(dim=-1, descending=False, stable=False)``: see the module docstring."""
    layout = _only(call)
    target = _along_dim(layout, _sort_dim(call, layout))
    return ShardingDecision((target,), (target, target))


@register_sharding_rule(torch.argsort, torch.Tensor.argsort)
def _argsort(call: OpCall) -> ShardingDecision:
    """``argsort(dim=-1, descending=False, stable=False)``: see the module docstring."""
    layout = _only(call)
    target = _along_dim(layout, _sort_dim(call, layout))
    return ShardingDecision((target,), target)


@register_sharding_rule(torch.histc, torch.Tensor.histc)
def _histc(call: OpCall) -> ShardingDecision:
    """``histc(bins=100, min=0, max=0)``: see the module docstring."""
    layout = _only(call)
    bins = _int_arg(call.arg(1, "bins", 100), call.name, "bins")
    low, high = float(call.arg(2, "min", 0)), float(call.arg(3, "max", 0))
    target = replicate_axes_where(layout)
    if low == high:
        target = _whole(layout, call.name, "with min == max the range is the data's own")
    placements: list[Placement] = [
        Partial(ReduceOp.SUM) if isinstance(p, Shard | RaggedShard) else Replicate()
        for p in target.placements
    ]
    return ShardingDecision((target,), Layout((bins,), layout.mesh, placements))


def _whole(layout: Layout, op: str, why: str) -> Layout:
    """``layout`` reduced to Replicate on Partial axes; refused if any axis shards it."""
    target = replicate_axes_where(layout)
    if not target.is_replicated:
        raise ShardingRuleError(
            f"{op} of {layout!r}: {why}, so every rank would find its own; redistribute the "
            "input to Replicate on every mesh axis first (or, for one_hot, pass num_classes)"
        )
    return target


@register_sharding_rule(F.one_hot)
def _one_hot(call: OpCall) -> ShardingDecision:
    """``one_hot(tensor, num_classes=-1)``: see the module docstring."""
    layout = _only(call)
    classes = _int_arg(call.arg(1, "num_classes", -1), call.name, "num_classes")
    if classes < 0:
        target = _whole(layout, call.name, "without num_classes the class count is data")
        return ShardingDecision((target,), ReplicatedResult(layout.mesh))
    target = replicate_axes_where(unshard_dims(layout, []))
    shape = (*layout.global_shape, classes)
    return ShardingDecision((target,), with_placements(target, target.placements, shape))


def _nonzero_decision(call: OpCall, layout: Layout, as_tuple: bool) -> ShardingDecision:
    target = _whole(layout, call.name, "the positions of the nonzero elements are data")
    result = ReplicatedResult(layout.mesh)
    if as_tuple:
        return ShardingDecision((target,), tuple(result for _ in range(max(layout.ndim, 1))))
    return ShardingDecision((target,), result)


@register_sharding_rule(torch.nonzero, torch.Tensor.nonzero)
def _nonzero(call: OpCall) -> ShardingDecision:
    """``nonzero(as_tuple=False)``: see the module docstring."""
    return _nonzero_decision(call, _only(call), bool(call.kwargs.get("as_tuple", False)))


@register_sharding_rule(torch.argwhere, torch.Tensor.argwhere)
def _argwhere(call: OpCall) -> ShardingDecision:
    """``argwhere``: ``nonzero`` by another name."""
    return _nonzero_decision(call, _only(call), as_tuple=False)


@register_sharding_rule(torch.where)
def _where(call: OpCall) -> ShardingDecision:
    """``torch.where(condition)`` is ``nonzero(condition, as_tuple=True)``; with ``input`` and
    ``other`` it is element-wise."""
    if len(call.args) == 1 and not call.kwargs:
        return _nonzero_decision(call, _only(call), as_tuple=True)
    return pointwise_decision(call, NONLINEAR)
