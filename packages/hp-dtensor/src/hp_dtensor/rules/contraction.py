"""Sharding rules for contractions: linear, matmul, mm, bmm, addmm, baddbmm, grouped_mm.

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

``grouped_mm`` (``torch._grouped_mm``, which ``F.grouped_mm`` calls): 3-d by 3-d is ``bmm``
over groups; 2-d ``[S, K]`` by 3-d ``[E, K, N]`` with ``offs`` (the mixture-of-experts form:
rows grouped by expert, group ``e`` ending at ``offs[e]``) splits ``K`` (``Partial(sum)``) and
``N`` like a matmul, while the rows and the experts are made ``Replicate`` and ``offs`` is
replicated (the offsets are global row positions). Other forms are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


_GROUPED_MM_PARAMS = ("mat_a", "mat_b", "offs", "bias", "out_dtype")


def _grouped_mm_layouts(call: OpCall) -> dict[str, Layout]:
    names = dict(zip(_GROUPED_MM_PARAMS, call.args, strict=False))
    names.update(call.kwargs)
    return {k: v for k, v in names.items() if isinstance(v, Layout)}


@register_sharding_rule(torch._grouped_mm)  # F.grouped_mm calls it without torch-function checks
def _grouped_mm(call: OpCall) -> ShardingDecision:
    """``grouped_mm(mat_a, mat_b, offs=None, bias=None)``: see the module docstring."""
    given = _grouped_mm_layouts(call)
    a, b, offs = given.get("mat_a"), given.get("mat_b"), given.get("offs")
    if a is None or b is None:
        raise ShardingRuleError(f"{call.describe()}: mat_a and mat_b must be DTensors")
    if a.ndim == 3 and b.ndim == 3 and offs is None:
        labels: list[tuple[str | None, ...]] = [("g", "m", "k"), ("g", "k", "n")]
        output: tuple[str, ...] = ("g", "m", "n")
    elif a.ndim == 2 and b.ndim == 3 and offs is not None and offs.ndim == 1:
        # Rows and groups are tied to offs (global positions): whole on every rank.
        a = with_placements(a, _unsharded(a, 0))
        b = with_placements(b, _unsharded(b, 0))
        offs = with_placements(offs, [Replicate()] * offs.mesh.ndim)
        labels = [("s", "k"), ("e", "k", "n"), ("e",)]
        output = ("s", "n")
    else:
        raise ShardingRuleError(
            f"{call.describe()}: grouped_mm of a {a.ndim}-d by a {b.ndim}-d operand "
            f"{'with' if offs is not None else 'without'} offs is not supported on DTensors; "
            "supported: 3-d by 3-d without offs, 2-d [S, K] by 3-d [E, K, N] with 1-d offs"
        )
    operands = [a, b] if offs is None else [a, b, offs]
    names = ["mat_a", "mat_b"] if offs is None else ["mat_a", "mat_b", "offs"]
    additive: tuple[int, ...] = ()
    bias = given.get("bias")
    if bias is not None:
        labels.append(("g", "n") if offs is None else ("e", "n"))
        if bias.ndim != 2:
            raise ShardingRuleError(f"{call.describe()}: a DTensor bias must be 2-d")
        operands.append(with_placements(bias, _unsharded(bias, 0)) if offs is not None else bias)
        names.append("bias")
        additive = (len(operands) - 1,)
    spec = ContractionSpec(tuple(labels), output, additive, anchors=(1, 0))
    inner = OpCall(call.func, call.name, tuple(operands), {}, call.rank)
    decision = contraction_decision(inner, spec)
    # offs (replicated above) carries no label of a and b's shards, so it stays replicated.
    by_name = dict(zip(names, decision.inputs, strict=True))
    order = [k for k in _ordered_names(call) if k in given]
    return ShardingDecision(
        tuple(by_name[k] for k in order), decision.outputs, local_func=_grouped_mm_local
    )


def _grouped_mm_local(mat_a: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The local product; ``mat_a`` made contiguous, since a redistribution can hand on a
    strided view the CPU kernel refuses (it wants row strides of whole 16-byte units)."""
    out: torch.Tensor = torch._grouped_mm(mat_a.contiguous(), *args, **kwargs)
    return out


def _ordered_names(call: OpCall) -> list[str]:
    """The names of the call's arguments, in the flattened ``(args, kwargs)`` order."""
    return [*_GROUPED_MM_PARAMS[: len(call.args)], *call.kwargs]


def _unsharded(layout: Layout, dim: int) -> list[Placement]:
    return [
        Replicate() if isinstance(p, RaggedShard) or (isinstance(p, Shard) and p.dim == dim) else p
        for p in layout.placements
    ]
