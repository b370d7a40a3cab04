"""Sharding rules for element-wise losses: ``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
``kl_div`` (class-index losses, ``cross_entropy`` and ``nll_loss``, are in :mod:`.nn`).

Each element's loss reads that element of the input, the target (and ``weight``) only, so the
layouts are the element-wise ones (:func:`.pointwise.pointwise_decision`, nonlinear): per mesh
axis, a dim sharded on any of them stays sharded and the others are sliced to match (a
replicated target, such as a plain tensor taken as replicated, costs nothing); Partial inputs
are reduced first. No shard is ever gathered; the reduction is a local one plus a sum:

* ``'none'``: the element-wise layout;
* ``'sum'``: each rank sums its own elements: ``Partial(sum)`` over the axes that shard them,
  ``Replicate`` over the others;
* ``'mean'``: the local sum divided by the *global* count (the broadcast shape's size), so
  uneven and empty shards are exact; with ``weight`` (``mse_loss``, ``l1_loss``) the
  denominator is the global sum of the weight: the local sums are all-reduced over the
  sharding axes with an autograd-aware all-reduce, so the weight's gradient stays exact;
* ``kl_div`` ``'batchmean'``: the local sum divided by the global size of the input's dim 0.

When no axis shards the elements, the op runs unchanged on the local tensors (the
single-device computation on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hp_dtensor.rules._binding import Bound, bind, named_decision
from hp_dtensor.rules.pointwise import NONLINEAR, pointwise_decision
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__: list[str] = []

_TENSOR_ARGS = ("input", "target", "weight")
_LEGACY = ("input", "target", "size_average", "reduce", "reduction")
_PARAMS: dict[Any, tuple[str, ...]] = {
    F.mse_loss: (*_LEGACY, "weight"),
    F.l1_loss: (*_LEGACY, "weight"),
    F.smooth_l1_loss: (*_LEGACY, "beta"),
    F.kl_div: (*_LEGACY, "log_target"),
}
# Options passed through to the local call unchanged.
_OPTIONS = ("beta", "log_target")


def _reduction(bound: Bound, op: str) -> str:
    size_average, reduce = bound.get("size_average"), bound.get("reduce")
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        return str(_reduction.legacy_get_string(size_average, reduce, emit_warning=False))
    reduction = str(bound.get("reduction", "mean"))
    allowed = ("none", "sum", "mean", "batchmean") if op == "kl_div" else ("none", "sum", "mean")
    if reduction not in allowed:
        raise ShardingRuleError(
            f"{op}: reduction must be one of {', '.join(repr(r) for r in allowed)}, got "
            f"{reduction!r}"
        )
    return reduction


@dataclass(frozen=True)
class _Denominator:
    """The global denominator of a ``'mean'`` (or ``'batchmean'``) over sharded elements.

    Attributes:
        count: the global count, or None when it is the sum of ``weight``.
        mesh: the mesh; ``axes``: the axes that shard the elements (the weight's local sums
            are all-reduced over them).
    """

    count: int | None
    mesh: Mesh
    axes: tuple[str, ...]

    def value(self, weight: torch.Tensor | None) -> torch.Tensor | int:
        if self.count is not None:
            return self.count
        assert weight is not None
        from hp_dtensor import collectives
        from hp_dtensor.device_mesh import DeviceMesh

        mesh = DeviceMesh.lookup(weight.device.type, self.mesh)
        total = weight.sum()
        for axis in self.axes:
            total = collectives.all_reduce(total, mesh, axis)
        return total


def _local_loss(
    *,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    loss: Callable[..., torch.Tensor],
    reduction: str,
    options: Mapping[str, Any],
    denominator: _Denominator | None,
) -> torch.Tensor:
    """The loss of the local elements; ``denominator`` turns a local sum into this rank's term
    of the global mean."""
    extra = dict(options)
    if weight is not None:
        extra["weight"] = weight
    if denominator is None:
        return loss(input, target, reduction=reduction, **extra)
    total = loss(input, target, reduction="sum", **extra)
    return total / denominator.value(weight)


def _shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, Layout):
        return value.global_shape
    return tuple(getattr(value, "shape", ()))


def _elementwise_loss(call: OpCall) -> ShardingDecision:
    """Element-wise losses: see the module docstring."""
    params = _PARAMS[call.func]
    bound = bind(call, params)
    reduction = _reduction(bound, call.name)
    names = [n for n in bound.tensor_names if n in _TENSOR_ARGS]
    if not names or len(names) != len(bound.tensor_names):
        raise ShardingRuleError(f"{call.describe()}: only input, target and weight may be DTensors")
    layouts = tuple(bound.values[n] for n in names)
    elementwise = pointwise_decision(
        OpCall(call.func, call.name, layouts, {}, call.rank), NONLINEAR
    )
    targets = dict(zip(names, elementwise.inputs, strict=True))
    elements: Layout = elementwise.outputs
    static: dict[str, Any] = {
        "loss": call.func,
        "options": {k: bound.values[k] for k in _OPTIONS if k in bound.values},
        "reduction": reduction,
        "denominator": None,
    }
    for name in _TENSOR_ARGS:
        value = bound.values.get(name)
        if value is not None and not isinstance(value, Layout):
            static[name] = value  # a plain 0-d tensor: the same scalar on every rank
    if reduction == "none":
        return named_decision(bound, targets, elements, _local_loss, static, call.name)
    sharding = [isinstance(p, Shard | RaggedShard) for p in elements.placements]
    scalar: list[Placement] = [Partial(ReduceOp.SUM) if s else Replicate() for s in sharding]
    output = Layout((), elements.mesh, scalar)
    if any(sharding) and reduction != "sum":
        axes = tuple(n for n, s in zip(elements.mesh.axis_names, sharding, strict=True) if s)
        static["denominator"] = _Denominator(
            _count(bound, reduction, elements.global_shape), elements.mesh, axes
        )
    return named_decision(bound, targets, output, _local_loss, static, call.name)


def _count(bound: Bound, reduction: str, shape: Sequence[int]) -> int | None:
    """The global count a ``'mean'`` divides by (None: the sum of the weight)."""
    if reduction == "batchmean":
        batch = _shape(bound.get("input"))
        return batch[0] if batch else 1  # kl_div divides a 0-d input's loss by nothing
    if bound.get("weight") is not None:
        return None
    return math.prod(shape)


register_sharding_rule(*_PARAMS)(_elementwise_loss)
