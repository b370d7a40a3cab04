"""Sharding rules for neural-network ops: softmax, norms, embedding, attention, losses, dropout.

Every rule keeps the shards the op can compute locally and redistributes the rest (never
rejecting where an exact local computation exists):

* ``softmax`` / ``log_softmax`` / ``softmin``: the softmax dim is gathered, other dims keep
  their shards; Partial inputs are reduced (the op is nonlinear).
* ``layer_norm`` / ``rms_norm``: the normalized (trailing) dims are gathered, leading dims
  keep their shards; ``weight`` and ``bias`` are replicated (their gradients come out
  ``Partial(sum)``, the dual layout).
* ``embedding``: per mesh axis, a ``Shard(1)`` weight (embedding dim) gives an output sharded
  on its last dim; a ``Shard(0)`` weight (vocab-parallel) gives ``Partial(sum)``: each rank
  looks up the ids in its vocab range and zeros the others; otherwise the weight is
  replicated and the output follows the ids' shards. Ids are replicated on axes that shard the
  weight. ``max_norm`` (an in-place renorm of the weight) and ``sparse`` gradients are rejected.
* ``scaled_dot_product_attention``: batch and head dims may be sharded (consistently across
  query, key, value and mask; grouped-query heads only when the key/value heads divide
  evenly over the sharding axes); the query-sequence dim may stay sharded (each query row is
  independent; a causal mask is rebuilt with this rank's row offset); key-sequence and feature
  dims are gathered. A ``Partial(sum)`` value stays partial (attention is linear in the
  value). ``dropout_p > 0`` is rejected.
* ``cross_entropy`` / ``nll_loss``: the class dim is gathered; batch dims may be sharded (the
  targets follow the logits, a replicated target is sliced for free) and are never gathered;
  a RaggedShard input is refused. ``reduction='none'`` is sharded like the targets, ``'sum'`` is
  ``Partial(sum)`` over the batch-sharding axes, and ``'mean'`` is ``Partial(sum)`` of the
  local sum divided by the *global* count (non-ignored targets, or their summed class weights),
  which one all-reduce of the local count finds. Class weights are replicated.
  Under ``hp_dtensor.parallel.loss_parallel()`` F.cross_entropy is dispatched as its own op
  (see :func:`vocab_parallel_cross_entropy_rule`): a class dim sharded on one mesh axis stays
  sharded and the loss is computed vocab-parallel.
* dropout (``dropout``, ``alpha_dropout``, and the channel-wise ``feature_*`` /
  ``dropout1d/2d/3d``): the input layout is kept (any Shard, nested, uneven or empty shards,
  RaggedShard), Partial inputs are reduced (the mask must hit the whole value); with
  ``training=False`` or ``p == 0`` it is the identity and keeps every placement, Partial
  included.

Randomness (dropout): distributed RNG. Every rank draws the *global-size* noise from its
global generator with the same call as the single-device op, and keeps its own region
(:func:`hp_dtensor.parallel.random.distributed_dropout`). With every rank seeded identically,
the output and its gradient are the single-device ones under the same seed (bit-identical on
CPU), for every layout, and the generator advances as on one device on every rank. The cost
is a transient global-size noise tensor per call on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hp_dtensor.rules._binding import Bound, bind, named_decision, ordered
from hp_dtensor.rules._common import (
    normalize_dim,
    replicate_axes_where,
    unshard_dims,
    with_placements,
)
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard

if TYPE_CHECKING:
    from hp_dtensor.parallel.random import DropoutVariant

__all__: list[str] = []


# Layout helpers ----------------------------------------------------------------------------------


def _replicated(layout: Layout) -> Layout:
    """``layout`` with every mesh axis Replicate."""
    return with_placements(layout, [Replicate()] * layout.mesh.ndim)


def _gather_dims(layout: Layout, dims: Sequence[int]) -> Layout:
    """``layout`` with ``dims`` unsharded and Partial axes reduced."""
    target = unshard_dims(layout, dims) if layout.ndim else layout
    return replicate_axes_where(target)


def _shard_order(*layouts: Layout | None) -> list[str]:
    """Mesh axis names, those sharding the given layouts first (earlier layouts win)."""
    order: list[str] = []
    for layout in layouts:
        if layout is not None:
            order += [n for n in layout.shard_order if n not in order]
    mesh = next(x for x in layouts if x is not None).mesh
    return order + [n for n in mesh.axis_names if n not in order]


# softmax ---------------------------------------------------------------------------------------

_IMPLICIT_DIM = (F.softmax, F.log_softmax, F.softmin)


def _softmax_rule(call: OpCall) -> ShardingDecision:
    """softmax-like: the softmax dim is gathered, other shards stay, Partial is reduced."""
    layout = call.layouts[0]
    dim = call.arg(1, "dim", None)
    if dim is None:
        if call.func not in _IMPLICIT_DIM:
            raise ShardingRuleError(f"{call.name}: needs a dim")
        dim = 0 if layout.ndim in (0, 1, 3) else 1  # torch's legacy implicit dim
    dims = [normalize_dim(int(dim), layout.ndim, call.name)] if layout.ndim else []
    target = _gather_dims(layout, dims)
    return ShardingDecision((target,), target)


register_sharding_rule(
    torch.softmax,
    torch.Tensor.softmax,
    F.softmax,
    torch.special.softmax,
    torch.log_softmax,
    torch.Tensor.log_softmax,
    F.log_softmax,
    torch.special.log_softmax,
    F.softmin,
)(_softmax_rule)


# layer_norm / rms_norm -------------------------------------------------------------------------

_LAYER_NORM_PARAMS = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")
_RMS_NORM_PARAMS = ("input", "normalized_shape", "weight", "eps")


def _norm_decision(call: OpCall, params: Sequence[str]) -> ShardingDecision:
    bound = bind(call, params)
    layout = bound.layout("input")
    if layout is None:
        raise ShardingRuleError(f"{call.name}: the input must be a DTensor")
    shape = bound.get("normalized_shape")
    count = 1 if isinstance(shape, int) else len(shape)
    if count > layout.ndim:
        raise ShardingRuleError(
            f"{call.name}: normalized_shape {shape} has more dims than the input "
            f"{layout.global_shape}"
        )
    target = _gather_dims(layout, range(layout.ndim - count, layout.ndim))
    targets = {name: _replicated(bound.values[name]) for name in bound.tensor_names}
    targets["input"] = target
    return ShardingDecision(ordered(bound, targets, call.name), target)


@register_sharding_rule(F.layer_norm, torch.layer_norm)
def _layer_norm(call: OpCall) -> ShardingDecision:
    """layer_norm: normalized dims gathered, leading shards kept, weight/bias replicated."""
    return _norm_decision(call, _LAYER_NORM_PARAMS)


@register_sharding_rule(F.rms_norm, torch.rms_norm)
def _rms_norm(call: OpCall) -> ShardingDecision:
    """rms_norm: normalized dims gathered, leading shards kept, weight replicated."""
    return _norm_decision(call, _RMS_NORM_PARAMS)


# embedding ------------------------------------------------------------------------------------

_F_EMBEDDING_PARAMS = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)
_TORCH_EMBEDDING_PARAMS = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")


def _embedding_placements(
    ids: Layout | None, weight: Layout, freq: bool
) -> tuple[list[Placement], list[Placement], list[Placement]]:
    """Per mesh axis: (ids target, weight target, output) placements."""
    ids_t: list[Placement] = []
    w_t: list[Placement] = []
    out: list[Placement] = []
    ids_ndim = ids.ndim if ids is not None else 0
    for axis, wp in enumerate(weight.placements):
        ip = ids.placements[axis] if ids is not None else Replicate()
        if isinstance(wp, Shard) and not (freq and wp.dim == 0):
            ids_t.append(Replicate())
            w_t.append(wp)
            out.append(Shard(ids_ndim) if wp.dim == 1 else Partial(ReduceOp.SUM))
        else:
            keep = isinstance(ip, Shard) and not freq
            ids_t.append(ip if keep else Replicate())
            w_t.append(Replicate())
            out.append(ip if keep else Replicate())
    return ids_t, w_t, out


def _embedding_rule(call: OpCall, params: Sequence[str]) -> ShardingDecision:
    bound = bind(call, params)
    weight = bound.layout("weight")
    if weight is None or weight.ndim != 2:
        raise ShardingRuleError(f"{call.name}: the weight must be a 2-d DTensor")
    if bound.get("max_norm") is not None:
        raise ShardingRuleError(
            f"{call.name}: max_norm renormalizes the weight in place, which a sharded or "
            "replicated weight cannot do consistently; renormalize the weight explicitly "
            "(e.g. torch.renorm on the gathered rows) and call embedding without max_norm"
        )
    if bound.get("sparse", False):
        raise ShardingRuleError(
            f"{call.name}: sparse gradients are not supported for a DTensor weight; use "
            "sparse=False"
        )
    ids = bound.layout("input")
    ids_value = bound.get("input")
    ids_shape = ids.global_shape if ids is not None else tuple(getattr(ids_value, "shape", ()))
    freq = bool(bound.get("scale_grad_by_freq", False))
    ids_p, w_p, out_p = _embedding_placements(ids, weight, freq)
    order = _shard_order(weight, ids)  # the weight keeps its layout
    w_target = with_placements(weight, w_p, shard_order=order)
    targets = {"weight": w_target}
    if ids is not None:
        targets["input"] = with_placements(ids, ids_p, shard_order=order)
    out_shape = (*ids_shape, weight.global_shape[1])
    output = Layout(out_shape, weight.mesh, out_p, order)
    pad = _global_padding_idx(bound.get("padding_idx"), weight.global_shape[0], call.func)
    start, stop = w_target.local_region(call.rank).box[0]
    static = {
        "padding_idx": pad,
        "scale_grad_by_freq": freq,
        "vocab": (start, stop) if any(isinstance(p, Partial) for p in out_p) else None,
    }
    return named_decision(bound, targets, output, _embedding_local, static, call.name)


def _global_padding_idx(given: Any, vocab: int, func: Any) -> int | None:
    """``padding_idx`` as a row of the whole weight, or None."""
    if given is None:
        return None
    pad = int(given)
    if func is torch.embedding:
        return pad if pad >= 0 else None  # aten: a negative padding_idx means none
    if not -vocab <= pad < vocab:
        raise ShardingRuleError(f"embedding: padding_idx {pad} is outside the vocab of {vocab}")
    return pad % vocab


def _embedding_local(
    *,
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None,
    scale_grad_by_freq: bool,
    vocab: tuple[int, int] | None,
) -> torch.Tensor:
    """The local embedding lookup; with ``vocab=(start, stop)`` a vocab-parallel one.

    Vocab-parallel: ids outside ``[start, stop)`` look up row 0 and are zeroed afterwards,
    so the local result is this rank's term of a ``Partial(sum)``. An empty vocab shard
    returns zeros still connected to the (empty) weight, so its gradient is defined.
    """
    if vocab is None:
        pad = -1 if padding_idx is None else padding_idx
        return torch.embedding(weight, input, pad, scale_grad_by_freq)
    start, stop = vocab
    if stop == start:
        zeros = weight.sum(0) * 0
        return zeros.expand(*input.shape, weight.shape[1]).clone()
    inside = (input >= start) & (input < stop)
    local_ids = torch.where(inside, input - start, torch.zeros_like(input))
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < stop else -1
    out = torch.embedding(weight, local_ids, pad, scale_grad_by_freq)
    return out.masked_fill(~inside.unsqueeze(-1), 0)


@register_sharding_rule(F.embedding)
def _f_embedding(call: OpCall) -> ShardingDecision:
    """F.embedding(input, weight, ...): see the module docstring."""
    return _embedding_rule(call, _F_EMBEDDING_PARAMS)


@register_sharding_rule(torch.embedding)
def _torch_embedding(call: OpCall) -> ShardingDecision:
    """torch.embedding(weight, input, ...): see the module docstring."""
    return _embedding_rule(call, _TORCH_EMBEDDING_PARAMS)


# scaled_dot_product_attention ------------------------------------------------------------------

_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


@dataclass(frozen=True)
class _Attention:
    """Shapes of one attention call, right-aligned to the output's dims."""

    q: Layout
    k: Layout
    v: Layout
    mask: Layout | None
    out_shape: tuple[int, ...]
    gqa: bool
    l_shard_ok: bool

    @property
    def ndim(self) -> int:
        return len(self.out_shape)

    def tensors(self) -> tuple[Layout, ...]:
        return (self.q, self.k, self.v)

    def aligned(self, layout: Layout, out_dim: int) -> int:
        """The dim of ``layout`` aligned with output dim ``out_dim`` (negative: absent)."""
        return out_dim - (self.ndim - layout.ndim)

    def head_dim(self) -> int:
        return self.ndim - 3


def _attention(call: OpCall, bound: Bound) -> _Attention:
    q, k, v = (bound.layout(n) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        raise ShardingRuleError(f"{call.name}: query, key and value must all be DTensors")
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ShardingRuleError(f"{call.name}: query, key and value need at least 2 dims")
    gqa = bool(bound.get("enable_gqa", False))
    ndim = max(q.ndim, k.ndim, v.ndim)
    batch: list[int] = []
    for od in range(ndim - 2):
        sizes = [
            t.global_shape[od - (ndim - t.ndim)] for t in (q, k, v) if od - (ndim - t.ndim) >= 0
        ]
        if gqa and od == ndim - 3 and q.ndim == ndim:
            batch.append(q.global_shape[od])
        else:
            batch.append(max(sizes))
    out_shape = (*batch, q.global_shape[-2], v.global_shape[-1])
    mask = bound.layout("attn_mask")
    causal = bool(bound.get("is_causal", False))
    l_ok = not causal or bound.get("attn_mask") is None
    return _Attention(q, k, v, mask, out_shape, gqa, l_ok)


def _batch_fit(att: _Attention, layout: Layout, od: int) -> Placement | None:
    """How ``layout`` follows an output sharded on batch dim ``od`` (None: it cannot)."""
    td = att.aligned(layout, od)
    if td < 0:
        return Replicate()
    size, want = layout.global_shape[td], att.out_shape[od]
    if size == want:
        return Shard(td)
    if size == 1:
        return Replicate()  # broadcast (or a single shared key/value head)
    if att.gqa and od == att.head_dim() and layout is not att.q:
        return Shard(td)  # grouped heads: checked for even division afterwards
    return None


def _batch_candidate(att: _Attention, layout: Layout, axis: int) -> int | None:
    """The output batch dim ``layout`` shards on ``axis``, if it is a usable one."""
    p = layout.placements[axis]
    if not isinstance(p, Shard) or p.dim >= layout.ndim - 2:
        return None
    od = p.dim + (att.ndim - layout.ndim)
    if layout.global_shape[p.dim] == 1 and att.out_shape[od] != 1:
        return None
    fits = [_batch_fit(att, t, od) for t in att.tensors()]
    return od if all(f is not None for f in fits) else None


def _axis_plan(att: _Attention, axis: int) -> tuple[str, int]:
    """``(strategy, output dim)`` for one mesh axis: batch, seq, partial or replicate."""
    q = att.q
    od = _batch_candidate(att, q, axis)
    if od is not None:
        return ("batch", od)
    if att.l_shard_ok and q.placements[axis] == Shard(q.ndim - 2):
        return ("seq", att.ndim - 2)
    for t in (att.k, att.v):
        od = _batch_candidate(att, t, axis)
        if od is not None:
            return ("batch", od)
    vp = att.v.placements[axis]
    if isinstance(vp, Partial) and vp.op in (ReduceOp.SUM, ReduceOp.AVG):
        return ("partial", -1)
    return ("replicate", -1)


def _gqa_even(att: _Attention, plans: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Replicate grouped-query heads unless the key/value heads divide evenly."""
    head = att.head_dim()
    if not att.gqa or head < 0:
        return plans
    kd = att.aligned(att.k, head)
    kv_heads = att.k.global_shape[kd] if kd >= 0 else 1
    if kv_heads in (1, att.out_shape[head]):
        return plans
    axes = [a for a, (kind, od) in enumerate(plans) if kind == "batch" and od == head]
    parts = math.prod(att.q.mesh.shape[a] for a in axes)
    if kv_heads % parts == 0:
        return plans
    return [("replicate", -1) if a in axes else p for a, p in enumerate(plans)]


def _sdpa_placements(
    att: _Attention, plans: list[tuple[str, int]]
) -> tuple[dict[str, list[Placement]], list[Placement]]:
    per: dict[str, list[Placement]] = {"query": [], "key": [], "value": [], "attn_mask": []}
    layouts = {"query": att.q, "key": att.k, "value": att.v, "attn_mask": att.mask}
    out: list[Placement] = []
    for axis, (kind, od) in enumerate(plans):
        for name, layout in layouts.items():
            if layout is None:
                continue
            per[name].append(_follow(att, layout, name, kind, od, axis))
        if kind in ("batch", "seq"):
            out.append(Shard(od))
        elif kind == "partial":
            out.append(att.v.placements[axis])
        else:
            out.append(Replicate())
    return per, out


def _follow(att: _Attention, layout: Layout, name: str, kind: str, od: int, axis: int) -> Placement:
    """The placement of input ``name`` on ``axis`` under the axis's strategy."""
    if kind == "batch":
        if name == "attn_mask":
            td = att.aligned(layout, od)
            ok = td >= 0 and layout.global_shape[td] == att.out_shape[od]
            return Shard(td) if ok else Replicate()
        fit = _batch_fit(att, layout, od)
        return fit if fit is not None else Replicate()
    if kind == "seq":
        if name == "query":
            return Shard(layout.ndim - 2)
        if name == "attn_mask":
            td = att.aligned(layout, od)
            ok = td >= 0 and layout.global_shape[td] == att.out_shape[od]
            return Shard(td) if ok else Replicate()
        return Replicate()
    if kind == "partial" and name == "value":
        return layout.placements[axis]
    return Replicate()


@register_sharding_rule(F.scaled_dot_product_attention)
def _sdpa(call: OpCall) -> ShardingDecision:
    """scaled_dot_product_attention: see the module docstring."""
    bound = bind(call, _SDPA_PARAMS)
    if float(bound.get("dropout_p", 0.0) or 0.0) > 0.0:
        raise ShardingRuleError(
            f"{call.name}: dropout_p > 0 draws a random attention mask that cannot be "
            "reproduced per shard yet; use dropout_p=0.0 (e.g. in eval) or apply dropout "
            "outside the attention"
        )
    att = _attention(call, bound)
    plans = _gqa_even(att, [_axis_plan(att, a) for a in range(att.q.mesh.ndim)])
    per, out = _sdpa_placements(att, plans)
    order = _shard_order(att.q, att.k, att.v, att.mask)
    targets = {
        name: with_placements(bound.values[name], per[name], shard_order=order)
        for name in bound.tensor_names
        if name in per
    }
    output = with_placements(att.q, out, att.out_shape, order)
    seq_sharded = any(kind == "seq" for kind, _ in plans)
    if not (seq_sharded and bool(bound.get("is_causal", False))):
        return ShardingDecision(ordered(bound, targets, call.name), output)
    row0 = targets["query"].local_region(call.rank).box[att.q.ndim - 2][0]
    static = {
        "row_offset": row0,
        "scale": bound.get("scale"),
        "enable_gqa": att.gqa,
    }
    return named_decision(bound, targets, output, _causal_rows_local, static, call.name)


def _causal_rows_local(
    *,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_offset: int,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention for query rows ``[row_offset, row_offset + L_local)``.

    torch's causal mask is the upper-left triangle ``ones(L, S).tril()``; the local rows are
    rows ``row_offset...`` of it.
    """
    rows, cols = query.shape[-2], key.shape[-2]
    mask = torch.ones(rows, cols, dtype=torch.bool, device=query.device).tril(row_offset)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


# cross_entropy / nll_loss ---------------------------------------------------------------------

_CROSS_ENTROPY_PARAMS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)
_NLL_LOSS_PARAMS = _CROSS_ENTROPY_PARAMS[:-1]


def _reduction(bound: Bound) -> str:
    size_average, reduce = bound.get("size_average"), bound.get("reduce")
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        return str(_reduction.legacy_get_string(size_average, reduce, emit_warning=False))
    reduction = str(bound.get("reduction", "mean"))
    if reduction not in ("none", "sum", "mean"):
        raise ShardingRuleError(
            f"loss: reduction must be 'none', 'sum' or 'mean', got {reduction!r}"
        )
    return reduction


@dataclass(frozen=True)
class _LossDims:
    """Which dim of the logits holds classes, and how logits dims map to target dims."""

    class_dim: int
    probabilities: bool

    def target_dim(self, input_dim: int) -> int:
        if self.probabilities or input_dim < self.class_dim:
            return input_dim
        return input_dim - 1

    def output_dim(self, input_dim: int) -> int:
        """The dim of a ``reduction='none'`` loss that logits dim ``input_dim`` becomes."""
        return input_dim if input_dim < self.class_dim else input_dim - 1

    def input_dim(self, target_dim: int) -> int:
        if self.probabilities or target_dim < self.class_dim:
            return target_dim
        return target_dim + 1


def _loss_placements(
    logits: Layout, target: Layout | None, dims: _LossDims
) -> tuple[list[Placement], list[Placement]]:
    """Per mesh axis: (logits, target) placements, sharding only batch dims, consistently."""
    lp: list[Placement] = []
    tp: list[Placement] = []
    for axis, p in enumerate(logits.placements):
        q = target.placements[axis] if target is not None else Replicate()
        if isinstance(p, Shard) and p.dim != dims.class_dim:
            lp.append(p)
            tp.append(Shard(dims.target_dim(p.dim)))
        elif isinstance(q, Shard) and dims.input_dim(q.dim) != dims.class_dim:
            lp.append(Shard(dims.input_dim(q.dim)))
            tp.append(q)
        else:
            lp.append(Replicate())
            tp.append(Replicate())
    return lp, tp


def _loss_rule(call: OpCall, params: Sequence[str], loss: Callable[..., Any]) -> ShardingDecision:
    bound = bind(call, params)
    logits = bound.layout("input")
    if logits is None:
        raise ShardingRuleError(f"{call.name}: the input (logits) must be a DTensor")
    target = bound.layout("target")
    for layout in (logits, target):
        if layout is not None and layout.ragged_axis is not None:
            # A flat-buffer shard has no batch dim to keep; gathering it here would hide
            # that the loss reads a parameter-like shard.
            raise ShardingRuleError(
                f"{call.describe()}: a RaggedShard input has no batch or class dim to keep "
                "sharded; redistribute it to Shard or Replicate first"
            )
    target_shape = target.global_shape if target is not None else ()
    class_dim = 1 if logits.ndim >= 2 else 0
    probabilities = call.name == "cross_entropy" and len(target_shape) == logits.ndim
    dims = _LossDims(class_dim, probabilities)
    lp, tp = _loss_placements(logits, target, dims)
    order = _shard_order(logits, target)
    targets = {"input": with_placements(logits, lp, shard_order=order)}
    if target is not None:
        targets["target"] = with_placements(target, tp, shard_order=order)
    weight = bound.layout("weight")
    if weight is not None:
        targets["weight"] = _replicated(weight)
    reduction = _reduction(bound)
    batch_axes = tuple(
        n for n, p in zip(logits.mesh.axis_names, tp, strict=True) if isinstance(p, Shard)
    )
    batch_shape = tuple(n for d, n in enumerate(logits.global_shape) if d != class_dim)
    if reduction == "none":
        out = [Shard(dims.output_dim(p.dim)) if isinstance(p, Shard) else p for p in lp]
        output = with_placements(logits, out, batch_shape, order)
    else:
        scalar = [Partial(ReduceOp.SUM) if isinstance(p, Shard) else Replicate() for p in tp]
        output = Layout((), logits.mesh, scalar)
    static: dict[str, Any] = {
        "loss": loss,
        "reduction": reduction,
        "options": _loss_options(bound, call.name),
        "mean_over": _MeanOver(logits.mesh, batch_axes, probabilities, math.prod(batch_shape))
        if reduction == "mean" and batch_axes
        else None,
    }
    return named_decision(bound, targets, output, _loss_local, static, call.name)


def _loss_options(bound: Bound, op: str) -> dict[str, Any]:
    options: dict[str, Any] = {"ignore_index": int(bound.get("ignore_index", -100))}
    if op == "cross_entropy":
        options["label_smoothing"] = float(bound.get("label_smoothing", 0.0))
    return options


@dataclass(frozen=True)
class _MeanOver:
    """How a ``'mean'`` loss over sharded batch dims finds its global denominator.

    Attributes:
        mesh: the mesh of the targets.
        axes: the mesh axes that shard the batch (the local counts are summed over them).
        probabilities: class-probability targets: the denominator is the batch size.
        batch_numel: the global number of samples (for probability targets).
    """

    mesh: Mesh
    axes: tuple[str, ...]
    probabilities: bool
    batch_numel: int

    def denominator(
        self, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
    ) -> torch.Tensor | int:
        """The global count (a constant for autograd), the same on every rank."""
        if self.probabilities:
            return self.batch_numel
        from hp_dtensor import collectives
        from hp_dtensor.device_mesh import DeviceMesh

        with torch.no_grad():
            kept = target != ignore_index
            if weight is None:
                count = kept.sum().to(torch.float64)
            else:
                picked = weight.detach()[torch.where(kept, target, torch.zeros_like(target))]
                count = (picked * kept).sum().to(torch.float64)
            mesh = DeviceMesh.lookup(target.device.type, self.mesh)
            for axis in self.axes:
                count = collectives.all_reduce(count, mesh, axis)
        return count


def _loss_local(
    *,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    loss: Callable[..., torch.Tensor],
    reduction: str,
    options: Mapping[str, Any],
    mean_over: _MeanOver | None,
) -> torch.Tensor:
    """The local loss: ``'mean'`` over sharded batch dims is ``local sum / global count``."""
    if mean_over is None:
        return loss(input, target, weight=weight, reduction=reduction, **options)
    total = loss(input, target, weight=weight, reduction="sum", **options)
    denominator = mean_over.denominator(target, weight, int(options["ignore_index"]))
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(total.dtype)
    return total / denominator


@register_sharding_rule(F.cross_entropy)
def _cross_entropy(call: OpCall) -> ShardingDecision:
    """cross_entropy: see the module docstring."""
    return _loss_rule(call, _CROSS_ENTROPY_PARAMS, F.cross_entropy)


def vocab_parallel_cross_entropy_rule(
    call: OpCall, local: Callable[..., torch.Tensor]
) -> ShardingDecision:
    """cross_entropy under ``loss_parallel``: a sharded class dim stays sharded.

    Applies when the logits' class dim (1, or 0 for 1-d logits) is sharded (``Shard``) on
    exactly one mesh axis, the targets are a DTensor of class indices and there are no class
    weights; any other call is decided exactly as a plain ``F.cross_entropy`` (the class dim
    is gathered). On the vocab axis the logits keep their shard, the targets are replicated
    and the loss is ``Replicate``: every rank of the axis holds the complete value (the local
    work all-reduces the row maxima, the sums of exponentials and the target logits over the
    axis). Other axes follow the plain rule: batch shards kept consistently on logits and
    targets (Partial logits reduced), ``'none'`` sharded like the targets, ``'sum'`` and
    ``'mean'`` ``Partial(sum)`` over batch-sharding axes, the mean divided by the global count
    of non-ignored targets.

    ``local(input, target, *, mesh, axis, num_classes, reduction, ignore_index,
    label_smoothing)`` computes the local loss (``mesh`` is the ``hp_layout.Mesh``, ``axis``
    the vocab axis); its backward must follow the adjoint convention (all-reduce the upstream
    gradient over ``axis``).
    """
    bound = bind(call, _CROSS_ENTROPY_PARAMS)
    logits, target = bound.layout("input"), bound.layout("target")
    plain = dataclasses.replace(call, func=F.cross_entropy, name="cross_entropy")
    if logits is None or target is None or bound.get("weight") is not None:
        return _cross_entropy(plain)
    class_dim = 1 if logits.ndim >= 2 else 0
    axes = logits.dim_sharding(class_dim) if logits.ndim else ()
    if len(axes) != 1 or logits.ragged_axis is not None or target.ndim != logits.ndim - 1:
        return _cross_entropy(plain)
    dims = _LossDims(class_dim, probabilities=False)
    lp, tp = _loss_placements(logits, target, dims)
    vocab = logits.mesh.axis_index(axes[0])
    lp[vocab], tp[vocab] = Shard(class_dim), Replicate()
    order = _shard_order(logits, target)
    targets = {
        "input": with_placements(logits, lp, shard_order=order),
        "target": with_placements(target, tp, shard_order=order),
    }
    reduction = _reduction(bound)
    names = logits.mesh.axis_names
    batch_axes = tuple(n for n, p in zip(names, tp, strict=True) if isinstance(p, Shard))
    batch_shape = tuple(n for d, n in enumerate(logits.global_shape) if d != class_dim)
    if reduction == "none":
        out = [Shard(p.dim) if isinstance(p, Shard) else Replicate() for p in tp]
        output = with_placements(logits, out, batch_shape, order)
    else:
        scalar = [Partial(ReduceOp.SUM) if isinstance(p, Shard) else Replicate() for p in tp]
        output = Layout((), logits.mesh, scalar)
    options = {
        "mesh": logits.mesh,
        "axis": axes[0],
        "num_classes": logits.global_shape[class_dim],
        "ignore_index": int(bound.get("ignore_index", -100)),
        "label_smoothing": float(bound.get("label_smoothing", 0.0)),
    }
    static: dict[str, Any] = {
        "local": local,
        "reduction": reduction,
        "options": options,
        "mean_over": _MeanOver(logits.mesh, batch_axes, False, math.prod(batch_shape))
        if reduction == "mean" and batch_axes
        else None,
    }
    return named_decision(bound, targets, output, _vocab_parallel_local, static, call.name)


def _vocab_parallel_local(
    *,
    input: torch.Tensor,
    target: torch.Tensor,
    local: Callable[..., torch.Tensor],
    reduction: str,
    options: Mapping[str, Any],
    mean_over: _MeanOver | None,
) -> torch.Tensor:
    """The local vocab-parallel loss; ``'mean'`` over sharded batch dims divides the local
    sum by the global count."""
    if mean_over is None:
        return local(input, target, reduction=reduction, **options)
    total = local(input, target, reduction="sum", **options)
    denominator = mean_over.denominator(target, None, int(options["ignore_index"]))
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(total.dtype)
    return total / denominator


@register_sharding_rule(F.nll_loss)
def _nll_loss(call: OpCall) -> ShardingDecision:
    """nll_loss: see the module docstring."""
    return _loss_rule(call, _NLL_LOSS_PARAMS, F.nll_loss)


# dropout --------------------------------------------------------------------------------------

_F_DROPOUT_PARAMS = ("input", "p", "training", "inplace")
_TORCH_DROPOUT_PARAMS = ("input", "p", "train")
_EVAL_BY_DEFAULT = (F.alpha_dropout, F.feature_alpha_dropout)
_F_DROPOUT = (
    F.dropout,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
)


_DROPOUT_VARIANTS: dict[Any, DropoutVariant] = {
    F.dropout: "dropout",
    torch.dropout: "dropout",
    torch.dropout_: "dropout",
    F.alpha_dropout: "alpha_dropout",
    torch.alpha_dropout: "alpha_dropout",
    torch.alpha_dropout_: "alpha_dropout",
    F.feature_alpha_dropout: "feature_alpha_dropout",
    torch.feature_alpha_dropout: "feature_alpha_dropout",
    torch.feature_alpha_dropout_: "feature_alpha_dropout",
    torch.feature_dropout: "feature_dropout",
    torch.feature_dropout_: "feature_dropout",
    F.dropout1d: "dropout1d",
    F.dropout2d: "dropout2d",
    F.dropout3d: "dropout3d",
}


def _dropout_rule(call: OpCall) -> ShardingDecision:
    """dropout family: identity when not training or p == 0; else the input layout with
    Partial reduced, and the local work is this rank's region of the single-device result
    (:func:`hp_dtensor.parallel.random.distributed_dropout`: the global noise is drawn on
    every rank, then sliced)."""
    params = _F_DROPOUT_PARAMS if call.func in _F_DROPOUT else _TORCH_DROPOUT_PARAMS
    bound = bind(call, params)
    layout = bound.layout("input")
    if layout is None:
        raise ShardingRuleError(f"{call.name}: the input must be a DTensor")
    default_training = call.func not in _EVAL_BY_DEFAULT
    training = bool(bound.get("training", bound.get("train", default_training)))
    p = float(bound.get("p", 0.5))
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return ShardingDecision((layout,), layout)
    target = replicate_axes_where(layout)
    in_place = call.inplace or bool(bound.get("inplace", False))
    if in_place and target != layout:
        raise ShardingRuleError(
            f"in-place {call.name} on {layout!r} would need {target!r} first (a Partial value "
            "must be reduced before the mask applies); redistribute the input first or use the "
            "out-of-place form"
        )
    from hp_dtensor.parallel.random import distributed_dropout  # no import cycle at call time

    local_func = functools.partial(
        distributed_dropout,
        p=p,
        training=True,
        layout=target,
        rank=call.rank,
        variant=_DROPOUT_VARIANTS[call.func],
        inplace=in_place,
    )
    return ShardingDecision(
        (target,), target, local_args=(target,), local_kwargs={}, local_func=local_func
    )


register_sharding_rule(
    F.dropout,
    torch.dropout,
    torch.dropout_,
    F.alpha_dropout,
    torch.alpha_dropout,
    torch.alpha_dropout_,
    F.feature_alpha_dropout,
    torch.feature_alpha_dropout,
    torch.feature_alpha_dropout_,
    torch.feature_dropout,
    torch.feature_dropout_,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
)(_dropout_rule)
