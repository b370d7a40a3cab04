"""Sharding rules for contractions: linear, matmul, mm, bmm, addmm, baddbmm, einsum-like.

Each op is described by dimension labels (``linear``: input ``[..., k]``, weight ``[o, k]``,
bias ``[o]``, output ``[..., o]``). Per mesh axis, the first input (in anchor order: weights
before activations, so parameters keep their layout and activations adapt) sharded on a label
decides:

* a label kept in the output -> the output is sharded on it; every input that has the label
  is sharded on it, the others are replicated (column-parallel, batch/sequence parallel);
* a contracted label -> the output is ``Partial(sum)``; every input with the label is
  sharded on it, additive inputs (bias) are partitioned (row-parallel);
* no shard but a ``Partial(sum | avg)`` input -> the output stays Partial in that input
  (multilinear), the other factors are replicated, additive inputs are partitioned;
* otherwise everything is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hp_dtensor.rules._common import with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__all__ = ["ContractionSpec", "contraction_decision"]


@dataclass(frozen=True)
class ContractionSpec:
    """Dimension labels of a contraction.

    Attributes:
        inputs: per tensor argument, one label per dim (None for a size-1 broadcast dim).
        output: one label per output dim.
        additive: indices of inputs that are added to the product (biases).
        anchors: input indices in priority order for choosing each axis's strategy.
    """

    inputs: tuple[tuple[str | None, ...], ...]
    output: tuple[str, ...]
    additive: tuple[int, ...] = ()
    anchors: tuple[int, ...] = ()


def _axis_strategy(
    axis: int, layouts: Sequence[Layout], spec: ContractionSpec, op: str
) -> tuple[str, str | None, Placement | None]:
    order = list(spec.anchors) + [i for i in range(len(layouts)) if i not in spec.anchors]
    for i in order:
        p = layouts[i].placements[axis]
        if isinstance(p, RaggedShard):
            raise ShardingRuleError(
                f"{op}: input {i} is RaggedShard on mesh axis "
                f"{layouts[i].mesh.axis_names[axis]!r}; gather the flat shard first"
            )
        if isinstance(p, Shard) and i not in spec.additive:
            label = spec.inputs[i][p.dim]
            if label is not None:
                return ("shard", label, None)
    multiplicative = [i for i in order if i not in spec.additive]
    for i in multiplicative:
        p = layouts[i].placements[axis]
        if isinstance(p, Partial) and p.op in (ReduceOp.SUM, ReduceOp.AVG):
            return ("partial", str(i), p)
    return ("replicate", None, None)


def contraction_decision(call: OpCall, spec: ContractionSpec) -> ShardingDecision:
    """Decide a contraction described by ``spec``."""
    layouts = call.layouts
    if len(layouts) != len(spec.inputs):
        raise ShardingRuleError(f"{call.describe()}: expected {len(spec.inputs)} tensor inputs")
    mesh = layouts[0].mesh
    targets: list[list[Placement]] = [[] for _ in layouts]
    out: list[Placement] = []
    for axis in range(mesh.ndim):
        kind, label, partial = _axis_strategy(axis, layouts, spec, call.name)
        for i, labels in enumerate(spec.inputs):
            if kind == "shard":
                assert label is not None
                if label in labels:
                    targets[i].append(Shard(labels.index(label)))
                elif label not in spec.output and i in spec.additive:
                    targets[i].append(Partial(ReduceOp.SUM))
                else:
                    targets[i].append(Replicate())
            elif kind == "partial":
                assert partial is not None
                assert label is not None
                if i == int(label) or i in spec.additive:
                    targets[i].append(partial)
                else:
                    targets[i].append(Replicate())
            else:
                targets[i].append(Replicate())
        if kind == "shard":
            assert label is not None
            out.append(
                Shard(spec.output.index(label)) if label in spec.output else Partial(ReduceOp.SUM)
            )
        elif kind == "partial":
            assert partial is not None
            out.append(partial)
        else:
            out.append(Replicate())
    out_shape = _output_shape(layouts, spec)
    anchor = spec.anchors[0] if spec.anchors else 0
    order = _output_order(layouts, spec, anchor)
    inputs = tuple(
        with_placements(layout, placements, shard_order=_input_order(layout, spec.inputs[i], order))
        for i, (layout, placements) in enumerate(zip(layouts, targets, strict=True))
    )
    output = Layout(out_shape, mesh, out, [n for n in order if n in mesh.axis_names])
    return ShardingDecision(inputs, output)


def _output_shape(layouts: Sequence[Layout], spec: ContractionSpec) -> tuple[int, ...]:
    sizes: dict[str, int] = {}
    for layout, labels in zip(layouts, spec.inputs, strict=True):
        for label, n in zip(labels, layout.global_shape, strict=True):
            if label is not None:
                sizes[label] = max(sizes.get(label, 1), n)
    return tuple(sizes[label] for label in spec.output)


def _output_order(layouts: Sequence[Layout], spec: ContractionSpec, anchor: int) -> list[str]:
    order: list[str] = []
    for i in [anchor, *range(len(layouts))]:
        for name in layouts[i].shard_order:
            if name not in order:
                order.append(name)
    order += [n for n in layouts[0].mesh.axis_names if n not in order]
    return order


def _input_order(layout: Layout, labels: Sequence[str | None], order: list[str]) -> list[str]:
    del layout, labels
    return order


def _batch_labels(count: int) -> list[str]:
    return [f"b{i}" for i in range(count)]


def _broadcast_labels(
    shape: tuple[int, ...], out_batch: list[str], sizes: tuple[int, ...]
) -> list[str | None]:
    labels: list[str | None] = []
    offset = len(out_batch) - len(shape)
    for j, n in enumerate(shape):
        label = out_batch[offset + j]
        labels.append(label if n == sizes[offset + j] or sizes[offset + j] == 1 else None)
        if n == 1 and sizes[offset + j] != 1:
            labels[-1] = None
    return labels


@register_sharding_rule(torch.nn.functional.linear)
def _linear(call: OpCall) -> ShardingDecision:
    layouts = call.layouts
    x, w = layouts[0], layouts[1]
    if w.ndim != 2:
        raise ShardingRuleError(f"linear: DTensor weights must be 2-d, got {w.global_shape}")
    batch = _batch_labels(x.ndim - 1)
    inputs: list[tuple[str | None, ...]] = [(*batch, "k"), ("o", "k")]
    additive: tuple[int, ...] = ()
    if len(layouts) == 3:
        inputs.append(("o",))
        additive = (2,)
    spec = ContractionSpec(tuple(inputs), (*batch, "o"), additive, anchors=(1, 0))
    return contraction_decision(call, spec)


def _matmul_spec(a: tuple[int, ...], b: tuple[int, ...], op: str) -> ContractionSpec:
    if len(a) == 0 or len(b) == 0:
        raise ShardingRuleError(f"{op}: both arguments need at least one dim")
    if len(a) == 1 and len(b) == 1:
        return ContractionSpec((("k",), ("k",)), (), anchors=(1, 0))
    if len(a) == 1:
        batch_b = _batch_labels(len(b) - 2)
        return ContractionSpec((("k",), (*batch_b, "k", "n")), (*batch_b, "n"), anchors=(1, 0))
    if len(b) == 1:
        batch_a = _batch_labels(len(a) - 2)
        return ContractionSpec(((*batch_a, "m", "k"), ("k",)), (*batch_a, "m"), anchors=(1, 0))
    out_batch_shape = tuple(torch.broadcast_shapes(torch.Size(a[:-2]), torch.Size(b[:-2])))
    batch = _batch_labels(len(out_batch_shape))
    la = _broadcast_labels(a[:-2], batch, out_batch_shape)
    lb = _broadcast_labels(b[:-2], batch, out_batch_shape)
    return ContractionSpec(((*la, "m", "k"), (*lb, "k", "n")), (*batch, "m", "n"), anchors=(1, 0))


@register_sharding_rule(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
def _matmul(call: OpCall) -> ShardingDecision:
    a, b = call.layouts
    return contraction_decision(call, _matmul_spec(a.global_shape, b.global_shape, call.name))


@register_sharding_rule(torch.Tensor.__rmatmul__)
def _rmatmul(call: OpCall) -> ShardingDecision:
    raise ShardingRuleError(
        f"{call.describe()}: a plain tensor on the left of @ with a DTensor; make it a DTensor"
    )


@register_sharding_rule(torch.mm, torch.Tensor.mm)
def _mm(call: OpCall) -> ShardingDecision:
    spec = ContractionSpec((("m", "k"), ("k", "n")), ("m", "n"), anchors=(1, 0))
    return contraction_decision(call, spec)


@register_sharding_rule(torch.bmm, torch.Tensor.bmm)
def _bmm(call: OpCall) -> ShardingDecision:
    spec = ContractionSpec((("b", "m", "k"), ("b", "k", "n")), ("b", "m", "n"), anchors=(1, 0))
    return contraction_decision(call, spec)


def _bias_labels(
    shape: tuple[int, ...], out: tuple[str, ...], out_shape: tuple[int, ...]
) -> tuple[str | None, ...]:
    offset = len(out) - len(shape)
    return tuple(
        out[offset + j] if n == out_shape[offset + j] and n != 1 else None
        for j, n in enumerate(shape)
    )


@register_sharding_rule(torch.addmm, torch.Tensor.addmm)
def _addmm(call: OpCall) -> ShardingDecision:
    bias, m1, m2 = call.layouts
    out = ("m", "n")
    out_shape = (m1.global_shape[0], m2.global_shape[1])
    spec = ContractionSpec(
        (_bias_labels(bias.global_shape, out, out_shape), ("m", "k"), ("k", "n")),
        out,
        additive=(0,),
        anchors=(2, 1),
    )
    return contraction_decision(call, spec)


@register_sharding_rule(torch.baddbmm, torch.Tensor.baddbmm)
def _baddbmm(call: OpCall) -> ShardingDecision:
    bias, m1, m2 = call.layouts
    out = ("b", "m", "n")
    out_shape = (m1.global_shape[0], m1.global_shape[1], m2.global_shape[2])
    spec = ContractionSpec(
        (_bias_labels(bias.global_shape, out, out_shape), ("b", "m", "k"), ("b", "k", "n")),
        out,
        additive=(0,),
        anchors=(2, 1),
    )
    return contraction_decision(call, spec)
