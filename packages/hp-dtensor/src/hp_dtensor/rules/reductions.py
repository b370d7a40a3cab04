"""Sharding rules for reductions: sum, mean, amax, amin, max/min, all/any, and their dim
forms.

Reducing a sharded dim gives a Partial result: ``sum`` and ``mean`` give ``Partial(sum)``
(``mean`` divides the local sum by the *global* count, so uneven shards are exact), ``amax``
and ``amin`` give ``Partial(max)`` / ``Partial(min)``. Dims that are not reduced keep their
shards. A Partial input stays Partial through ``sum``/``mean`` (they are linear) and is
reduced first for ``amax``/``amin``. ``max(dim)``/``min(dim)``, which also return indices,
gather the reduced dim first (indices are positions in the whole dim). ``all`` and ``any`` are
the min and the max of truth values: a sharded reduced dim gives ``Partial(min)`` /
``Partial(max)`` (an empty shard holds the identity, ``True`` / ``False``), and a Partial
input is reduced first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor.rules._common import normalize_dim, unshard_dims, with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__ = ["reduction_decision"]


def _dims(call: OpCall, layout: Layout) -> tuple[tuple[int, ...], bool]:
    dim = call.arg(1, "dim", None)
    keepdim = bool(call.arg(2, "keepdim", False))
    if isinstance(dim, torch.dtype):  # sum(x, dtype) is not a dim
        dim = None
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0 and call.name != "sum"):
        return tuple(range(layout.ndim)), keepdim
    items = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({normalize_dim(d, layout.ndim, call.name) for d in items})), keepdim


def _reduced_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if d in dims else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in dims)


def reduction_decision(call: OpCall, op: ReduceOp) -> ShardingDecision:
    """Decide a reduction whose sharded reduced dims leave ``Partial(op)``."""
    (layout,) = call.layouts[:1]
    dims, keepdim = _dims(call, layout)
    full = len(dims) == layout.ndim
    placements: list[Placement] = list(layout.placements)
    names = layout.mesh.axis_names
    for axis, p in enumerate(placements):
        if isinstance(p, Partial) and (
            op is not ReduceOp.SUM or p.op not in (ReduceOp.SUM, ReduceOp.AVG)
        ):
            placements[axis] = Replicate()
        if isinstance(p, RaggedShard) and not full:
            placements[axis] = Replicate()
    target = with_placements(layout, placements)
    out: list[Placement] = []
    for p in target.placements:
        if (isinstance(p, Shard) and p.dim in dims) or isinstance(p, RaggedShard):
            out.append(Partial(op))
        elif isinstance(p, Shard):
            shift = 0 if keepdim else sum(1 for d in dims if d < p.dim)
            out.append(Shard(p.dim - shift))
        else:
            out.append(p)
    partial_ops = {q.op for q in out if isinstance(q, Partial)}
    if len(partial_ops) > 1:
        # A reduction of one kind over data partial in another: reduce the old partial first.
        target = with_placements(
            target, [Replicate() if isinstance(p, Partial) else p for p in target.placements]
        )
        out = [Replicate() if isinstance(q, Partial) and q.op is not op else q for q in out]
    out_shape = _reduced_shape(layout.global_shape, dims, keepdim)
    order = [n for n in target.shard_order if isinstance(out[names.index(n)], Shard)]
    output = Layout(out_shape, layout.mesh, out, order)
    inputs = (target, *call.layouts[1:])
    return ShardingDecision(inputs, output)


def _local_mean(global_count: int) -> Any:
    def local_mean(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.sum(x, *args, **kwargs) / global_count

    return local_mean


@register_sharding_rule(torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum)
def _sum(call: OpCall) -> ShardingDecision:
    return reduction_decision(call, ReduceOp.SUM)


@register_sharding_rule(torch.mean, torch.Tensor.mean)
def _mean(call: OpCall) -> ShardingDecision:
    decision = reduction_decision(call, ReduceOp.SUM)
    layout = call.layouts[0]
    dims, _ = _dims(call, layout)
    count = math.prod(layout.global_shape[d] for d in dims)
    target = decision.inputs[0]
    split = target.ragged_axis is not None or any(target.dim_sharding(d) for d in dims)
    # Over unsharded dims the local mean is the mean: keep the op itself.
    local_func = _local_mean(count) if split and count else None
    return ShardingDecision(decision.inputs, decision.outputs, local_func=local_func)


def _identity_fill(dtype: torch.dtype, op: ReduceOp) -> float | int:
    """The identity of max (min): the lowest (highest) value of ``dtype``."""
    low = op is ReduceOp.MAX
    if dtype.is_floating_point:
        return float("-inf") if low else float("inf")
    info = torch.iinfo(dtype)
    return info.min if low else info.max


def _local_extreme(op: ReduceOp, dims: tuple[int, ...], keepdim: bool) -> Any:
    """amax/amin that returns the reduction's identity for an empty local shard, so a rank
    holding no elements still joins the cross-rank reduction with a neutral value."""
    reduce = torch.amax if op is ReduceOp.MAX else torch.amin

    def local_extreme(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if all(x.shape[d] > 0 for d in dims):
            return reduce(x, dims, keepdim)
        shape = _reduced_shape(x.shape, dims, keepdim)
        # Multiply by a zero-sum of x so the result stays in x's autograd graph.
        return torch.full(shape, _identity_fill(x.dtype, op), dtype=x.dtype) + x.sum() * 0

    return local_extreme


def _extreme(call: OpCall, op: ReduceOp) -> ShardingDecision:
    decision = reduction_decision(call, op)
    dims, keepdim = _dims(call, call.layouts[0])
    return ShardingDecision(
        decision.inputs, decision.outputs, local_func=_local_extreme(op, dims, keepdim)
    )


@register_sharding_rule(torch.amax, torch.Tensor.amax)
def _amax(call: OpCall) -> ShardingDecision:
    return _extreme(call, ReduceOp.MAX)


@register_sharding_rule(torch.amin, torch.Tensor.amin)
def _amin(call: OpCall) -> ShardingDecision:
    return _extreme(call, ReduceOp.MIN)


def _max_min(call: OpCall, op: ReduceOp) -> ShardingDecision:
    layout = call.layouts[0]
    other = call.arg(1, "dim", None)
    if len(call.layouts) > 1:
        elementwise = "maximum" if op is ReduceOp.MAX else "minimum"
        raise ShardingRuleError(
            f"{call.describe()}: element-wise {call.name} of two tensors is "
            f"torch.{elementwise}; call that"
        )
    if other is None:
        return _extreme(call, op)
    dim = normalize_dim(int(other), layout.ndim, call.name)
    keepdim = bool(call.arg(2, "keepdim", False))
    target = unshard_dims(layout, [dim])
    target = with_placements(
        target, [Replicate() if isinstance(p, Partial) else p for p in target.placements]
    )
    out_placements: list[Placement] = []
    for p in target.placements:
        if isinstance(p, Shard) and not keepdim and p.dim > dim:
            out_placements.append(Shard(p.dim - 1))
        else:
            out_placements.append(p)
    shape = _reduced_shape(layout.global_shape, [dim], keepdim)
    out = with_placements(target, out_placements, shape)
    return ShardingDecision((target,), (out, out))


@register_sharding_rule(torch.max, torch.Tensor.max)
def _max(call: OpCall) -> ShardingDecision:
    return _max_min(call, ReduceOp.MAX)


@register_sharding_rule(torch.min, torch.Tensor.min)
def _min(call: OpCall) -> ShardingDecision:
    return _max_min(call, ReduceOp.MIN)


@register_sharding_rule(torch.all, torch.Tensor.all)
def _all(call: OpCall) -> ShardingDecision:
    """``all(dim=None, keepdim=False)``: every element true is the min of the truth values."""
    return reduction_decision(call, ReduceOp.MIN)


@register_sharding_rule(torch.any, torch.Tensor.any)
def _any(call: OpCall) -> ShardingDecision:
    """``any(dim=None, keepdim=False)``: some element true is the max of the truth values."""
    return reduction_decision(call, ReduceOp.MAX)
