"""Sharding rules for writes at indexed positions: ``scatter`` / ``scatter_`` (with ``src``
or ``value``, and ``reduce``), ``scatter_add`` / ``scatter_add_``, ``index_add`` /
``index_add_``.

Along ``dim`` the index holds positions, so the written dim of ``input`` (and the output) is
made ``Replicate``. Along every other dim the op is element-wise (position ``j`` of the index
and the source writes position ``j`` of the output), so a dim sharded on any of the tensors
stays sharded on all of them when they have the same extent there (``scatter`` allows an
index smaller than the input; such a dim is made ``Replicate``).

* ``scatter`` / ``scatter_add``: the index and the source are split along ``dim`` only if
  the input is replicated there, which the rule does not do (each rank would write its own
  positions into its own copy); they are made ``Replicate`` along ``dim``. Partial inputs
  are reduced (overwriting is not linear).
* ``index_add``: the index is 1-d, one entry per slice of ``source`` along ``dim``. An index
  split over an axis (with ``source`` split along ``dim`` the same way) is kept: each rank
  adds its own slices and the out-of-place result is ``Partial(sum)`` (the input is taken as
  a partial value, whole at coordinate 0). ``index_add`` is linear in ``input`` and
  ``source`` together, so ``Partial(sum)`` on either stays partial (the other is partitioned
  for free). The in-place form keeps self's layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hp_dtensor.rules._binding import Bound, bind, ordered
from hp_dtensor.rules._common import normalize_dim, with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__: list[str] = []


def _order(*layouts: Layout | None) -> list[str]:
    """Mesh axis names, those sharding the given layouts first (earlier layouts win)."""
    order: list[str] = []
    for layout in layouts:
        if layout is not None:
            order += [n for n in layout.shard_order if n not in order]
    mesh = next(x for x in layouts if x is not None).mesh
    return order + [n for n in mesh.axis_names if n not in order]


def _aligned_shard(
    layouts: Sequence[Layout | None], axis: int, dim: int, inplace: bool
) -> int | None:
    """A dim other than ``dim`` that one of ``layouts`` (only the first, self, for an in-place
    op: its layout cannot change) shards on ``axis`` and every given layout spans with the
    first one's extent, else None."""
    first = layouts[0]
    assert first is not None
    for layout in layouts[:1] if inplace else layouts:
        if layout is None:
            continue
        p = layout.placements[axis]
        if not isinstance(p, Shard) or p.dim == dim:
            continue
        extent = first.global_shape[p.dim]
        if all(t is None or t.global_shape[p.dim] == extent for t in layouts):
            return p.dim
    return None


def _ragged_refused(call: OpCall, layouts: Sequence[Layout | None]) -> None:
    for layout in layouts:
        if layout is not None and any(isinstance(p, RaggedShard) for p in layout.placements):
            raise ShardingRuleError(
                f"{call.describe()}: a RaggedShard operand has no per-dim layout to write into; "
                "redistribute it to Shard or Replicate first"
            )


_SCATTER_PARAMS = ("input", "dim", "index", "src", "reduce")


def _scatter_source(bound: Bound) -> str | None:
    """The name under which ``src`` (or ``value``) was given."""
    for name in ("src", "value"):
        if name in bound.values:
            return name
    return None


@register_sharding_rule(
    torch.scatter,
    torch.Tensor.scatter,
    torch.Tensor.scatter_,
    torch.scatter_add,
    torch.Tensor.scatter_add,
    torch.Tensor.scatter_add_,
)
def _scatter(call: OpCall) -> ShardingDecision:
    """``scatter`` / ``scatter_add``: see the module docstring."""
    bound = bind(call, _SCATTER_PARAMS)
    layout, index = bound.layout("input"), bound.layout("index")
    if layout is None or index is None:
        raise ShardingRuleError(
            f"{call.describe()}: the input and the index must be DTensors (a plain index is "
            "taken as replicated only where plain tensors are implicitly replicated)"
        )
    name = _scatter_source(bound)
    src = bound.layout(name) if name is not None else None
    if index.ndim != layout.ndim or (src is not None and src.ndim != layout.ndim):
        raise RuntimeError(
            f"{call.name}: index and src must have as many dims as the input ({layout.ndim})"
        )
    _ragged_refused(call, (layout, index, src))
    dim = normalize_dim(int(bound.get("dim")), layout.ndim, call.name) if layout.ndim else 0
    per: dict[str, list[Placement]] = {"input": [], "index": [], "src": []}
    for axis in range(layout.mesh.ndim):
        d = _aligned_shard((layout, index, src), axis, dim, call.inplace)
        for key in per:
            per[key].append(Shard(d) if d is not None else Replicate())
    order = _order(layout, index, src)
    targets = {"input": with_placements(layout, per["input"], shard_order=order)}
    targets["index"] = with_placements(index, per["index"], shard_order=order)
    if src is not None and name is not None:
        targets[name] = with_placements(src, per["src"], shard_order=order)
    return ShardingDecision(ordered(bound, targets, call.name), targets["input"])


_INDEX_ADD_PARAMS = ("input", "dim", "index", "source", "alpha")


def _index_add_axis(
    layout: Layout,
    index: Layout,
    source: Layout,
    axis: int,
    dim: int,
    inplace: bool,
) -> tuple[Placement, Placement, Placement, Placement]:
    """(input, index, source, output) placements on one mesh axis."""
    d = _aligned_shard((layout, source), axis, dim, inplace)
    if d is not None:
        return Shard(d), Replicate(), Shard(d), Shard(d)
    sum_partial = Partial(ReduceOp.SUM)
    if inplace:
        if layout.placements[axis] == sum_partial:
            return sum_partial, Replicate(), sum_partial, sum_partial
        return Replicate(), Replicate(), Replicate(), Replicate()
    split_index = index.placements[axis] == Shard(0)
    split_source = source.ndim > 0 and source.placements[axis] == Shard(dim)
    if index.ndim == 1 and (split_index or split_source):
        # Each rank adds its own slices: a local computation plus a sum.
        return sum_partial, Shard(0), Shard(dim), sum_partial
    if sum_partial in (layout.placements[axis], source.placements[axis]):
        return sum_partial, Replicate(), sum_partial, sum_partial
    return Replicate(), Replicate(), Replicate(), Replicate()


@register_sharding_rule(torch.index_add, torch.Tensor.index_add, torch.Tensor.index_add_)
def _index_add(call: OpCall) -> ShardingDecision:
    """``index_add(dim, index, source, alpha=1)``: see the module docstring."""
    bound = bind(call, _INDEX_ADD_PARAMS)
    layout, index, source = (bound.layout(n) for n in ("input", "index", "source"))
    if layout is None or index is None or source is None:
        raise ShardingRuleError(
            f"{call.describe()}: input, index and source must be DTensors (plain tensors are "
            "taken as replicated only where plain tensors are implicitly replicated)"
        )
    if index.ndim > 1 or source.ndim != layout.ndim:
        raise RuntimeError(
            f"{call.name}: index must be 0-d or 1-d and source must have as many dims as the "
            f"input ({layout.ndim})"
        )
    _ragged_refused(call, (layout, index, source))
    dim = normalize_dim(int(bound.get("dim")), layout.ndim, call.name) if layout.ndim else 0
    rows = [
        _index_add_axis(layout, index, source, axis, dim, call.inplace)
        for axis in range(layout.mesh.ndim)
    ]
    order = _order(index, layout, source)
    columns = list(zip(*rows, strict=True))
    targets = {
        "input": with_placements(layout, columns[0], shard_order=order),
        "index": with_placements(index, columns[1], shard_order=order),
        "source": with_placements(source, columns[2], shard_order=order),
    }
    output = with_placements(layout, columns[3], shard_order=order)
    return ShardingDecision(ordered(bound, targets, call.name), output)
