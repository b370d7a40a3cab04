"""Sharding rules for scans along a dim: ``cumsum`` and ``diff``.

Each output element along the scanned dim reads the elements before it (``cumsum``) or its
neighbours (``diff``), so the scanned dim is made ``Replicate`` (a planned all-gather along
the axes that shard it); every other dim keeps its shards. Both are linear: a
``Partial(sum | avg)`` input stays partial (``diff`` with ``prepend`` / ``append`` reduces
Partial first, since those tensors are concatenated to it as they are).
"""

from __future__ import annotations

import torch

from hp_dtensor.rules._binding import bind, ordered
from hp_dtensor.rules._common import normalize_dim, unshard_dims, with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Partial, Placement, ReduceOp, Replicate

__all__: list[str] = []


def _linear_target(layout: Layout, dims: list[int], keep_partial: bool) -> Layout:
    """``layout`` with ``dims`` unsharded; Partial(sum | avg) kept when ``keep_partial``."""
    target = unshard_dims(layout, dims) if layout.ndim else layout
    placements: list[Placement] = [
        p
        if not isinstance(p, Partial) or (keep_partial and p.op in (ReduceOp.SUM, ReduceOp.AVG))
        else Replicate()
        for p in target.placements
    ]
    return with_placements(target, placements)


@register_sharding_rule(torch.cumsum, torch.Tensor.cumsum, torch.Tensor.cumsum_)
def _cumsum(call: OpCall) -> ShardingDecision:
    """``cumsum(dim, dtype=None)``: see the module docstring."""
    layouts = call.layouts
    if len(layouts) != 1:
        raise ShardingRuleError(f"{call.describe()}: only the input may be a DTensor")
    layout = layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim")), layout.ndim, call.name)
    target = _linear_target(layout, [dim], keep_partial=True)
    return ShardingDecision((target,), target)


_DIFF_PARAMS = ("input", "n", "dim", "prepend", "append")


@register_sharding_rule(torch.diff, torch.Tensor.diff)
def _diff(call: OpCall) -> ShardingDecision:
    """``diff(n=1, dim=-1, prepend=None, append=None)``: see the module docstring.

    ``prepend`` and ``append`` match the input's shape except along ``dim`` (torch requires
    it), so they take the input's placements.
    """
    bound = bind(call, _DIFF_PARAMS)
    layout = bound.layout("input")
    if layout is None or layout.ndim == 0:
        raise ShardingRuleError(f"{call.describe()}: the input must be a DTensor of 1 or more dims")
    n = int(bound.get("n", 1))
    dim = normalize_dim(int(bound.get("dim", -1)), layout.ndim, call.name)
    extra = [k for k in ("prepend", "append") if bound.get(k) is not None]
    for name in extra:
        value = bound.layout(name)
        if value is None or value.ndim != layout.ndim:
            raise ShardingRuleError(
                f"{call.describe()}: {name} must be a DTensor (or a plain tensor taken as "
                "replicated) with as many dims as the input"
            )
    target = _linear_target(layout, [dim], keep_partial=not extra)
    targets = {"input": target}
    for name in extra:
        targets[name] = with_placements(
            bound.values[name], target.placements, shard_order=target.shard_order
        )
    size = sum(t.global_shape[dim] for t in targets.values()) - n
    shape = list(layout.global_shape)
    shape[dim] = max(size, 0)
    output = with_placements(target, target.placements, shape)
    return ShardingDecision(ordered(bound, targets, call.name), output)
