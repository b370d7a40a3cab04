"""Sharding rules for element-wise ops, with broadcasting and Partial where it is exact.

Per mesh axis the output is sharded if any input is sharded there (on a dim of the output;
inputs broadcast along that dim stay replicated), else Partial if some input is Partial and
the op is linear in the arguments that carry it, else replicated. Inputs are redistributed to
match (a Replicate input becomes a free local slice; a Partial one that cannot stay partial is
reduced).

Linearity: *sum-linear* ops (``add``, ``sub``, ``neg``, casts, ``lerp`` in its two tensor
arguments) keep ``Partial(sum | avg)`` when every partial-carrying argument is partial (a
replicated one is partitioned for free) and no additive scalar would be counted once per rank;
*product-linear* ops (``mul``, ``div`` numerator) keep it for exactly one argument while the
others are replicated. Everything else reduces its Partial inputs first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hp_dtensor.rules._common import with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
    torch_functions,
)
from hp_layout import Layout, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__ = ["Linearity", "pointwise_decision"]


@dataclass(frozen=True)
class Linearity:
    """How an element-wise op treats Partial inputs.

    Attributes:
        kind: ``"sum"`` (jointly linear in ``positions``), ``"product"`` (linear in each of
            ``positions`` separately) or ``"none"``.
        positions: indices, among the op's tensor arguments, that may carry a Partial; None
            means all of them.
        additive_scalars: True when non-tensor number arguments are added to the result
            (``add(x, 2)``): those would be counted once per rank under ``Partial(sum)``.
    """

    kind: str = "none"
    positions: tuple[int, ...] | None = None
    additive_scalars: bool = False

    def carries(self, index: int) -> bool:
        """True if tensor argument ``index`` may stay Partial."""
        return self.kind != "none" and (self.positions is None or index in self.positions)


NONLINEAR = Linearity()


def _broadcast_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))


def _nonzero_scalars(call: OpCall) -> bool:
    values = list(call.args) + list(call.kwargs.values())
    for v in values:
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int | float) and v != 0:
            return True
        if isinstance(v, torch.Tensor):
            # A 0-d plain tensor is a scalar on every rank; its value is not read here
            # (that would synchronize with the device), so it counts as nonzero.
            return True
    return False


def _choose_axis(
    axis: int,
    layouts: list[Layout],
    out_shape: tuple[int, ...],
    linear: Linearity,
    additive_ok: bool,
    reference: int,
) -> Placement:
    out_ndim = len(out_shape)
    order = sorted(range(len(layouts)), key=lambda i: (i != reference, -layouts[i].numel, i))
    for i in order:
        p = layouts[i].placements[axis]
        if isinstance(p, Shard):
            d_out = p.dim + out_ndim - layouts[i].ndim
            if layouts[i].global_shape[p.dim] == out_shape[d_out]:
                return Shard(d_out)
        if isinstance(p, RaggedShard):
            return p
    partial = [i for i in order if isinstance(layouts[i].placements[axis], Partial)]
    if partial:
        ops = {layouts[i].placements[axis].op for i in partial}  # type: ignore[union-attr]
        op = next(iter(ops))
        if (
            len(ops) == 1
            and op in (ReduceOp.SUM, ReduceOp.AVG)
            and all(linear.carries(i) for i in partial)
            and (additive_ok or op is ReduceOp.AVG)
        ):
            return Partial(op)
    return Replicate()


def _target(
    layout: Layout,
    index: int,
    out_placements: Sequence[Placement],
    out_shape: tuple[int, ...],
    linear: Linearity,
    keep_partial: dict[int, int],
    order: Sequence[str],
    op: str,
) -> Layout:
    out_ndim = len(out_shape)
    placements: list[Placement] = []
    for axis, o in enumerate(out_placements):
        if isinstance(o, Shard):
            d = o.dim - (out_ndim - layout.ndim)
            sharded = d >= 0 and layout.global_shape[d] == out_shape[o.dim]
            placements.append(Shard(d) if sharded else Replicate())
        elif isinstance(o, RaggedShard):
            if layout.global_shape != out_shape:
                if layout.numel != 1:
                    raise ShardingRuleError(
                        f"{op}: cannot broadcast a tensor of shape {layout.global_shape} "
                        f"against a RaggedShard tensor of shape {out_shape}"
                    )
                placements.append(Replicate())
            else:
                placements.append(o)
        elif isinstance(o, Partial):
            if (linear.kind == "sum" and linear.carries(index)) or (
                linear.kind == "product" and keep_partial.get(axis) == index
            ):
                placements.append(o)
            else:
                placements.append(Replicate())
        else:
            placements.append(Replicate())
    return with_placements(layout, placements, shard_order=order)


def pointwise_decision(
    call: OpCall,
    linear: Linearity = NONLINEAR,
    passive: Sequence[int] = (),
) -> ShardingDecision:
    """Decide an element-wise call. ``passive`` lists tensor-argument indices whose data the op
    does not read (``type_as``'s ``other``): they keep their layout and shape nothing."""
    layouts = list(call.layouts)
    active = [i for i in range(len(layouts)) if i not in passive]
    shapes = [layouts[i].global_shape for i in active]
    out_shape = _broadcast_shape(shapes)
    mesh = layouts[0].mesh
    additive_ok = not (linear.additive_scalars and _nonzero_scalars(call))
    if call.inplace:
        self_layout = layouts[0]
        if self_layout.global_shape != out_shape:
            raise ShardingRuleError(
                f"in-place {call.name}: the result shape {out_shape} differs from self's "
                f"{self_layout.global_shape}"
            )
        out_placements = list(self_layout.placements)
        for axis, p in enumerate(out_placements):
            if isinstance(p, Partial) and not (
                linear.carries(0) and (additive_ok or p.op is ReduceOp.AVG)
            ):
                raise ShardingRuleError(
                    f"in-place {call.name} on a {p!r} tensor (mesh axis "
                    f"{mesh.axis_names[axis]!r}) is not exact; redistribute self to Replicate "
                    "or use the out-of-place op"
                )
        order = list(self_layout.shard_order)
        reference = 0
    else:
        active_layouts = [layouts[i] for i in active]
        reference = max(range(len(active_layouts)), key=lambda i: (active_layouts[i].numel, -i))
        out_placements = [
            _choose_axis(
                axis, active_layouts, out_shape, _remap(linear, active), additive_ok, reference
            )
            for axis in range(mesh.ndim)
        ]
        order = list(active_layouts[reference].shard_order)
        reference = active[reference]
    keep_partial: dict[int, int] = {}
    if linear.kind == "product":
        for axis, o in enumerate(out_placements):
            if isinstance(o, Partial):
                carriers = [
                    i for i in active if linear.carries(i) and layouts[i].placements[axis] == o
                ]
                keep_partial[axis] = (
                    0 if call.inplace else max(carriers, key=lambda i: (layouts[i].numel, -i))
                )
    inputs = []
    for i, layout in enumerate(layouts):
        if i in passive:
            inputs.append(layout)
        else:
            inputs.append(
                _target(
                    layout, i, out_placements, out_shape, linear, keep_partial, order, call.name
                )
            )
    output = with_placements(layouts[reference], out_placements, out_shape, order)
    return ShardingDecision(tuple(inputs), output)


def _remap(linear: Linearity, active: Sequence[int]) -> Linearity:
    if linear.positions is None:
        return linear
    positions = tuple(k for k, i in enumerate(active) if i in linear.positions)
    return Linearity(linear.kind, positions, linear.additive_scalars)


def _rule(linear: Linearity, passive: Sequence[int] = ()) -> Callable[[OpCall], ShardingDecision]:
    def rule(call: OpCall) -> ShardingDecision:
        return pointwise_decision(call, linear, passive)

    return rule


SUM_LINEAR = Linearity("sum", None, additive_scalars=True)
SUM_LINEAR_NO_SCALARS = Linearity("sum", None, additive_scalars=False)
PRODUCT = Linearity("product", None)
NUMERATOR = Linearity("product", (0,))

_SUM_LINEAR_OPS = ["add", "sub", "subtract", "rsub", "neg", "negative", "positive"]
_UNARY_LINEAR_OPS = [
    "clone",
    "contiguous",
    "detach",
    "float",
    "double",
    "half",
    "bfloat16",
    "conj",
    "resolve_conj",
    "resolve_neg",
]
_NONLINEAR_OPS = [
    "abs",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "sin",
    "cos",
    "tan",
    "tanh",
    "sigmoid",
    "relu",
    "relu6",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "elu",
    "leaky_relu",
    "hardtanh",
    "hardswish",
    "hardsigmoid",
    "logsigmoid",
    "erf",
    "erfc",
    "sign",
    "sgn",
    "square",
    "pow",
    "float_power",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "masked_fill",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "not_equal",
    "logical_not",
    "logical_and",
    "logical_or",
    "isnan",
    "isinf",
    "isfinite",
    "nan_to_num",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "fmod",
    "remainder",
    "floor_divide",
    "atan2",
    "addcmul",
    "addcdiv",
    "copysign",
    "bitwise_not",
    "and",
    "or",
    "xor",
    "invert",
    "mod",
    "floordiv",
]

register_sharding_rule(torch_functions(*_SUM_LINEAR_OPS))(_rule(SUM_LINEAR))
register_sharding_rule(torch_functions(*_UNARY_LINEAR_OPS))(_rule(SUM_LINEAR_NO_SCALARS))
register_sharding_rule(torch_functions("mul", "multiply"))(_rule(PRODUCT))
register_sharding_rule(torch_functions("div", "divide", "true_divide", "truediv"))(_rule(NUMERATOR))
register_sharding_rule(torch_functions(*_NONLINEAR_OPS))(_rule(NONLINEAR))
register_sharding_rule(torch_functions("lerp"))(_rule(Linearity("sum", (0, 1))))
# torch.where also has a one-argument form (nonzero): see rules.selection.
register_sharding_rule(torch.Tensor.where)(_rule(NONLINEAR))


@register_sharding_rule(torch.Tensor.type_as)
def _type_as(call: OpCall) -> ShardingDecision:
    return pointwise_decision(call, SUM_LINEAR_NO_SCALARS, passive=(1,))


def _to_rule(call: OpCall) -> ShardingDecision:
    for value in list(call.args[1:]) + list(call.kwargs.values()):
        if isinstance(value, torch.device | str):
            raise ShardingRuleError(
                f"to({value!r}) on a DTensor would move its shards off the mesh's device; "
                "build the DTensor on the target device instead (to(dtype) is fine)"
            )
    passive = tuple(range(1, len(call.layouts)))
    return pointwise_decision(call, SUM_LINEAR_NO_SCALARS, passive=passive)


register_sharding_rule(torch.Tensor.to)(_to_rule)


def _rdiv_guard(call: OpCall) -> ShardingDecision:
    # other / self: linear only in `other`, which is never a DTensor here (it's a number).
    return pointwise_decision(call, NONLINEAR)


register_sharding_rule(torch.Tensor.__rtruediv__, torch.Tensor.__rdiv__)(_rdiv_guard)
