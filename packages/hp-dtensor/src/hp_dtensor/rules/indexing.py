"""Sharding rules for concatenation, splitting, indexing and index-like ops.

All of these *select or move* elements without combining them, so a ``Partial`` axis passes
through unchanged, whatever its reduction (zeros written by ``tril``/``triu`` are the same on
every rank, so they are exact too). The rules differ in which dims must be whole on every
rank:

* ``cat`` / ``concat`` / ``concatenate``: the cat dim is made ``Replicate`` on the first
  input, and every input is redistributed to that layout (other dims keep their shards, so
  inputs must agree there, as torch requires; the cat dims may differ in size).
* ``stack``: every input takes the first input's layout; shards shift past the new dim.
* ``split`` (size or list of sizes), ``split_with_sizes``, ``tensor_split``, ``chunk``,
  ``unbind``, ``narrow``, ``select``: the dim they cut is made ``Replicate`` first (so the
  local call's global sizes and offsets are right), other dims keep their shards. ``narrow``
  that keeps the whole dim leaves a shard in place.
* ``__getitem__``: ints (and 0-d integer index tensors) and slices that do not keep a whole
  dim make that dim ``Replicate`` first; full slices (``x[:, 0:n]`` with ``n`` the size,
  ``x[..., :]``), ``None``, ``Ellipsis`` and bools leave shards in place and renumber them.
  Advanced (tensor) indexing is accepted only on dims that are not sharded, and only with
  index tensors that are plain 0-d integers, Python int lists, or *fully replicated*
  DTensors; anything else raises ``ShardingRuleError`` (gathering a dim for a gather is the
  caller's decision: redistribute the dim to ``Replicate`` first). A boolean mask gives a
  data-dependent shape and is rejected.
* ``__setitem__`` (``x[index] = value``): in place, so ``x`` keeps its layout; the index is
  planned as for ``__getitem__`` and must not cut or tensor-index a sharded dim (refused: an
  in-place write cannot gather its target); ``value`` takes the written region's layout.
* ``index_select``: the indexed dim is made ``Replicate``; a replicated index keeps the
  other shards; an index sharded on dim 0 gives an output sharded on the indexed dim (each
  rank selects its own indices from the replicated input), so it is never gathered.
* ``tril`` / ``triu``: shards stay everywhere; the local call shifts ``diagonal`` by the
  rank's row offset minus its column offset, which is the exact local piece.
* ``roll``: rolled dims are made ``Replicate`` (all dims when ``dims`` is omitted);
  ``flip`` / ``fliplr`` / ``flipud``: flipped dims are made ``Replicate``.

A ``RaggedShard`` input is always gathered first. Every "made Replicate" above is a planned
redistribution the executor performs before the local call (an all-gather along the axes
that shard the dim), never a silent change of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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
from hp_layout import Layout, Placement, Replicate, Shard

__all__ = ["IndexPlan", "plan_index"]


# Helpers ---------------------------------------------------------------------------------------


def _shift_shards(
    layout: Layout, shape: Sequence[int], new_dim: Callable[[int], int | None]
) -> Layout:
    """``layout`` (no RaggedShard) with shape ``shape`` and each ``Shard(d)`` moved to
    ``Shard(new_dim(d))`` (``None``: the dim is gone, so it must not be sharded)."""
    placements: list[Placement] = []
    for p in layout.placements:
        if isinstance(p, Shard):
            moved = new_dim(p.dim)
            assert moved is not None, f"dim {p.dim} is removed but still sharded"
            placements.append(Shard(moved))
        else:
            placements.append(p)
    return with_placements(layout, placements, shape)


def _as_int(value: Any, op: str, what: str) -> int:
    if isinstance(value, Layout):
        raise ShardingRuleError(
            f"{op}: {what} given as a DTensor is not supported (its value would be needed to "
            "plan the layouts); pass a Python int"
        )
    return int(value)


def _with_dim(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


# cat / stack ------------------------------------------------------------------------------------


def _tensor_list(call: OpCall) -> list[Layout]:
    tensors = call.arg(0, "tensors")
    if not isinstance(tensors, list | tuple) or not tensors:
        raise ShardingRuleError(f"{call.name}: expected a non-empty sequence of DTensors")
    if not all(isinstance(t, Layout) for t in tensors):
        raise ShardingRuleError(
            f"{call.name}: every input must be a DTensor, got {[type(t).__name__ for t in tensors]}"
        )
    return list(tensors)


def _legacy_empty(layout: Layout, ndim: int) -> bool:
    """torch.cat skips 1-d empty inputs when the others have more dims."""
    return layout.global_shape == (0,) and ndim != 1


def _like(layout: Layout, reference: Layout) -> Layout:
    return with_placements(layout, reference.placements, shard_order=reference.shard_order)


@register_sharding_rule(torch.cat, torch.concat, torch.concatenate)
def _cat(call: OpCall) -> ShardingDecision:
    """``cat(tensors, dim)``: the cat dim is made Replicate on the first input and every input
    is redistributed to that layout; the output has it too, with the summed cat dim."""
    layouts = _tensor_list(call)
    ndim = max(t.ndim for t in layouts)
    kept = [t for t in layouts if not _legacy_empty(t, ndim)] or layouts[:1]
    first = kept[0]
    dim = normalize_dim(int(call.arg(1, "dim", call.kwargs.get("axis", 0))), ndim, call.name)
    reference = unshard_dims(first, [dim])
    inputs = tuple(t if _legacy_empty(t, ndim) else _like(t, reference) for t in layouts)
    size = sum(t.global_shape[dim] for t in kept)
    output = with_placements(
        reference, reference.placements, _with_dim(first.global_shape, dim, size)
    )
    return ShardingDecision(inputs, output)


@register_sharding_rule(torch.stack)
def _stack(call: OpCall) -> ShardingDecision:
    """``stack(tensors, dim)``: every input takes the first input's layout; shards at or after
    the new dim shift by one."""
    layouts = _tensor_list(call)
    reference = unshard_dims(layouts[0], [])
    dim = normalize_dim(int(call.arg(1, "dim", 0)), reference.ndim + 1, call.name)
    inputs = tuple(_like(t, reference) for t in layouts)
    shape = (*reference.global_shape[:dim], len(layouts), *reference.global_shape[dim:])
    output = _shift_shards(reference, shape, lambda d: d + (d >= dim))
    return ShardingDecision(inputs, output)


# split family -----------------------------------------------------------------------------------


def _meta_shapes(call: OpCall, layout: Layout) -> list[tuple[int, ...]]:
    """Output shapes of ``call``'s op on a meta tensor of the global shape."""
    for value in list(call.args[1:]) + list(call.kwargs.values()):
        if isinstance(value, Layout):
            raise ShardingRuleError(
                f"{call.name}: split points given as a DTensor are not supported; pass ints"
            )
    meta = torch.empty(layout.global_shape, device="meta")
    pieces = call.func(meta, *call.args[1:], **call.kwargs)
    return [tuple(p.shape) for p in pieces]


@register_sharding_rule(
    torch.split,
    torch.Tensor.split,
    torch.split_with_sizes,
    torch.Tensor.split_with_sizes,
    torch.tensor_split,
    torch.Tensor.tensor_split,
    torch.chunk,
    torch.Tensor.chunk,
)
def _split(call: OpCall) -> ShardingDecision:
    """``split`` / ``split_with_sizes`` / ``tensor_split`` / ``chunk`` along ``dim``: the dim
    is made Replicate, so the local call's global sizes are the right ones; each piece keeps
    the other shards."""
    layout = call.layouts[0]
    dim = normalize_dim(int(call.arg(2, "dim", 0)), layout.ndim, call.name)
    target = unshard_dims(layout, [dim])
    outputs = tuple(
        with_placements(target, target.placements, s) for s in _meta_shapes(call, layout)
    )
    return ShardingDecision((target,), outputs)


@register_sharding_rule(torch.unbind, torch.Tensor.unbind)
def _unbind(call: OpCall) -> ShardingDecision:
    """``unbind(dim)``: the dim is made Replicate; each slice keeps the other shards."""
    layout = call.layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim", 0)), layout.ndim, call.name)
    target = unshard_dims(layout, [dim])
    shape = layout.global_shape[:dim] + layout.global_shape[dim + 1 :]
    piece = _shift_shards(target, shape, lambda d: d - (d > dim))
    return ShardingDecision((target,), tuple(piece for _ in range(layout.global_shape[dim])))


@register_sharding_rule(torch.narrow, torch.Tensor.narrow)
def _narrow(call: OpCall) -> ShardingDecision:
    """``narrow(dim, start, length)``: the dim is made Replicate unless the narrow keeps all
    of it (then the local call keeps the whole local shard)."""
    layout = call.layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim")), layout.ndim, call.name)
    size = layout.global_shape[dim]
    start = _as_int(call.arg(2, "start"), call.name, "start")
    length = _as_int(call.arg(3, "length"), call.name, "length")
    start = start + size if start < 0 else start
    output_shape = _with_dim(layout.global_shape, dim, length)
    if start == 0 and length == size:
        target = unshard_dims(layout, [])
        local_len = target.local_shape(call.rank)[dim]
        output = with_placements(target, target.placements, output_shape)
        return ShardingDecision(
            (target,), output, local_args=(target, dim, 0, local_len), local_kwargs={}
        )
    target = unshard_dims(layout, [dim])
    return ShardingDecision((target,), with_placements(target, target.placements, output_shape))


@register_sharding_rule(torch.select, torch.Tensor.select)
def _select(call: OpCall) -> ShardingDecision:
    """``select(dim, index)``: the dim is made Replicate and removed; other shards shift."""
    layout = call.layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim")), layout.ndim, call.name)
    _as_int(call.arg(2, "index"), call.name, "index")
    target = unshard_dims(layout, [dim])
    shape = layout.global_shape[:dim] + layout.global_shape[dim + 1 :]
    return ShardingDecision((target,), _shift_shards(target, shape, lambda d: d - (d > dim)))


# __getitem__ ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexPlan:
    """How a ``__getitem__`` index acts on a tensor of a given shape.

    Attributes:
        shape: the result's shape.
        placement_of: result dim of each input dim that survives as a (sliced) dim.
        cut: input dims that must be whole on every rank (ints, 0-d index tensors, slices
            that do not keep the whole dim).
        advanced: input dims indexed by tensors (or int lists).
        index: the index to apply to the local tensor (full slices become ``slice(None)``).
    """

    shape: tuple[int, ...]
    placement_of: dict[int, int]
    cut: tuple[int, ...]
    advanced: tuple[int, ...]
    index: Any


@dataclass(frozen=True)
class _Item:
    kind: str  # "new", "int", "slice", "adv", "ellipsis"
    size: int = 0  # new-dim size for "new"
    shape: tuple[int, ...] = ()  # index shape for "adv"
    value: Any = None  # the original index element


def _list_shape(value: Any, op: str) -> tuple[int, ...]:
    if isinstance(value, list | tuple):
        shapes = {_list_shape(v, op) for v in value}
        if len(shapes) > 1:
            raise IndexError(f"{op}: ragged nested index list {value!r}")
        inner = next(iter(shapes)) if shapes else ()
        return (len(value), *inner)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShardingRuleError(
            f"{op}: index lists must hold ints only (got {value!r}); boolean masks give a "
            "data-dependent shape, and tensors inside lists are not supported"
        )
    return ()


def _classify(value: Any, op: str) -> _Item:
    if value is None:
        return _Item("new", size=1, value=value)
    if isinstance(value, bool):
        return _Item("new", size=int(value), value=value)
    if isinstance(value, int):
        return _Item("int", value=value)
    if value is Ellipsis:
        return _Item("ellipsis", value=value)
    if isinstance(value, slice):
        for part in (value.start, value.stop, value.step):
            if part is not None and not isinstance(part, int):
                raise ShardingRuleError(f"{op}: slice bounds must be ints, got {value!r}")
        return _Item("slice", value=value)
    if isinstance(value, Layout):
        if not value.is_replicated:
            raise ShardingRuleError(
                f"{op}: an index DTensor must be fully replicated, got {value!r}; "
                "redistribute it to Replicate on every mesh axis first"
            )
        if value.ndim == 0:
            return _Item("int", value=value)
        return _Item("adv", shape=value.global_shape, value=value)
    if isinstance(value, torch.Tensor):
        if value.dtype is torch.bool:
            raise ShardingRuleError(
                f"{op}: a boolean tensor index is not supported on DTensors (the result shape "
                "depends on its values); use None or a Python bool"
            )
        return _Item("int", value=value)
    if isinstance(value, list):
        return _Item("adv", shape=_list_shape(value, op), value=value)
    raise ShardingRuleError(
        f"{op}: unsupported index element {type(value).__name__}; use ints, slices, None, "
        "Ellipsis, bools, int lists or replicated integer DTensors"
    )


def _items(index: Any, op: str) -> tuple[list[_Item], bool]:
    """The index as items, and whether it was a tuple."""
    if isinstance(index, tuple):
        return [_classify(v, op) for v in index], True
    if isinstance(index, list) and not all(
        isinstance(v, int) and not isinstance(v, bool) for v in index
    ):
        raise ShardingRuleError(
            f"{op}: index with a tuple, not a list of mixed elements ({index!r}); torch's "
            "treatment of such lists is deprecated"
        )
    return [_classify(index, op)], False


def _broadcast(shapes: Sequence[tuple[int, ...]], op: str) -> tuple[int, ...]:
    ndim = max(len(s) for s in shapes)
    out: list[int] = []
    for k in range(ndim):
        sizes = {s[k - ndim + len(s)] for s in shapes if k - ndim + len(s) >= 0} - {1}
        if len(sizes) > 1:
            raise IndexError(f"{op}: index shapes {list(shapes)} cannot be broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _arrange(
    entries: list[tuple[str, int, int]], adv_shape: tuple[int, ...]
) -> list[tuple[str, int, int]]:
    """Put the advanced-index result dims where torch puts them."""
    positions = [k for k, e in enumerate(entries) if e[0] == "adv"]
    if not positions:
        return entries
    block = [("advout", -1, n) for n in adv_shape]
    rest = [e for e in entries if e[0] != "adv"]
    if positions == list(range(positions[0], positions[-1] + 1)):
        return entries[: positions[0]] + block + entries[positions[-1] + 1 :]
    return block + rest


def plan_index(layout: Layout, index: Any, op: str = "getitem") -> IndexPlan:
    """Plan ``tensor[index]`` for a tensor with ``layout`` (see the module docstring)."""
    items, as_tuple = _items(index, op)
    shape = layout.global_shape
    consuming = sum(1 for it in items if it.kind in ("int", "slice", "adv"))
    if sum(1 for it in items if it.kind == "ellipsis") > 1:
        raise ShardingRuleError(f"{op}: an index on a DTensor can have at most one Ellipsis")
    if sum(1 for it in items if isinstance(it.value, bool)) > 1:
        raise ShardingRuleError(
            f"{op}: more than one Python bool in an index is not supported (torch broadcasts "
            "them together as masks); use None"
        )
    if consuming > len(shape):
        raise IndexError(f"{op}: too many indices for a tensor of dimension {len(shape)}")
    has_adv = any(it.kind == "adv" for it in items)
    if has_adv and any(isinstance(it.value, bool) for it in items):
        raise ShardingRuleError(
            f"{op}: Python bools mixed with tensor indices are not supported; use None"
        )
    entries: list[tuple[str, int, int]] = []  # (kind, input dim, size)
    cut: list[int] = []
    advanced: list[int] = []
    local: list[Any] = []
    dim = 0
    for it in items:
        local.append(it.value)
        if it.kind == "new":
            entries.append(("new", -1, it.size))
        elif it.kind == "ellipsis":
            for _ in range(len(shape) - consuming):
                entries.append(("dim", dim, shape[dim]))
                dim += 1
        elif it.kind == "int":
            if isinstance(it.value, int) and not -shape[dim] <= it.value < shape[dim]:
                raise IndexError(
                    f"{op}: index {it.value} is out of bounds for dimension {dim} with size "
                    f"{shape[dim]}"
                )
            cut.append(dim)
            dim += 1
        elif it.kind == "slice":
            start, stop, step = it.value.indices(shape[dim])
            if step <= 0:
                raise ValueError(f"{op}: step must be greater than zero")
            if (start, stop, step) == (0, shape[dim], 1):
                local[-1] = slice(None)
            else:
                cut.append(dim)
            entries.append(("dim", dim, len(range(start, stop, step))))
            dim += 1
        else:
            advanced.append(dim)
            entries.append(("adv", dim, 0))
            dim += 1
    entries += [("dim", d, shape[d]) for d in range(dim, len(shape))]
    adv_shape: tuple[int, ...] = ()
    if has_adv:
        adv_shape = _broadcast([it.shape for it in items if it.kind == "adv"], op)
    arranged = _arrange(entries, adv_shape)
    return IndexPlan(
        shape=tuple(e[2] for e in arranged),
        placement_of={e[1]: k for k, e in enumerate(arranged) if e[0] == "dim"},
        cut=tuple(cut),
        advanced=tuple(advanced),
        index=tuple(local) if as_tuple else local[0],
    )


@register_sharding_rule(torch.Tensor.__getitem__)
def _getitem(call: OpCall) -> ShardingDecision:
    """``x[index]``: see the module docstring for what is gathered and what is rejected."""
    layout = call.layouts[0]
    plan = plan_index(layout, call.arg(1, "indices"), "getitem")
    for d in plan.advanced:
        axes = layout.dim_sharding(d)
        if axes:
            raise ShardingRuleError(
                f"getitem: tensor (advanced) index on dim {d}, which is sharded over mesh "
                f"axes {list(axes)} in {layout!r}; advanced indexing is only supported on "
                f"dims that are not sharded: redistribute dim {d} to Replicate first "
                f"(x.redistribute(mesh, placements)) or index another dim"
            )
    target = unshard_dims(layout, plan.cut)
    output = _shift_shards(target, plan.shape, plan.placement_of.get)
    index_layouts = call.layouts[1:]
    return ShardingDecision(
        (target, *index_layouts), output, local_args=(target, plan.index), local_kwargs={}
    )


def _value_target(value: Layout, region: Layout) -> Layout:
    """``value`` laid out to be written into ``region`` (right-aligned broadcasting: a dim
    of the value that spans a sharded region dim is sharded alike, a broadcast one is
    replicated; Partial is reduced, since overwriting is not linear)."""
    offset = region.ndim - value.ndim
    placements: list[Placement] = []
    for p in region.placements:
        d = p.dim - offset if isinstance(p, Shard) else -1
        spans = (
            isinstance(p, Shard) and d >= 0 and value.global_shape[d] == region.global_shape[p.dim]
        )
        placements.append(Shard(d) if spans and value.global_shape[d] != 1 else Replicate())
    return with_placements(value, placements, shard_order=region.shard_order)


@register_sharding_rule(torch.Tensor.__setitem__)
def _setitem(call: OpCall) -> ShardingDecision:
    """``x[index] = value``: in place, so ``x`` keeps its layout. The index is planned as for
    ``__getitem__``; the dims it cuts (ints, slices that do not keep the whole dim) and the
    dims it indexes with tensors must not be sharded (an in-place write cannot gather its
    target: refused), nor may ``x`` be Partial. The written region keeps ``x``'s other shards
    and ``value`` is laid out like it."""
    layout = call.layouts[0]
    value = call.arg(2, "value")
    plan = plan_index(layout, call.arg(1, "key"), "setitem")
    sharded = [d for d in (*plan.cut, *plan.advanced) if layout.dim_sharding(d)]
    if sharded or layout.ragged_axis is not None or replicate_axes_where(layout) != layout:
        raise ShardingRuleError(
            f"setitem on {layout!r}: an in-place write keeps the tensor's layout, but this "
            f"index needs dims {sharded or 'all'} whole (or the tensor is Partial or "
            "RaggedShard); redistribute the tensor first, or build the result out of place "
            "(torch.where, scatter, index_put)"
        )
    region = _shift_shards(layout, plan.shape, plan.placement_of.get)
    index_layouts = call.layouts[1:-1] if isinstance(value, Layout) else call.layouts[1:]
    inputs: tuple[Layout, ...] = (layout, *index_layouts)
    if isinstance(value, Layout):
        inputs = (*inputs, _value_target(value, region))
    return ShardingDecision(inputs, layout, local_args=(layout, plan.index, value), local_kwargs={})


# index_select -----------------------------------------------------------------------------------


def _index_placement(p: Placement) -> Placement:
    return p if isinstance(p, Shard) else Replicate()


@register_sharding_rule(torch.index_select, torch.Tensor.index_select)
def _index_select(call: OpCall) -> ShardingDecision:
    """``index_select(dim, index)``: the dim is made Replicate; a replicated index keeps the
    input's other shards (and Partial); an index sharded on dim 0 shards the output's ``dim``
    the same way, with the input made Replicate on those axes."""
    x = call.layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim")), x.ndim, call.name)
    index = call.arg(2, "index")
    target_x = unshard_dims(x, [dim])
    if not isinstance(index, Layout):
        numel = 1 if not isinstance(index, torch.Tensor) else max(index.numel(), 1)
        output = with_placements(
            target_x, target_x.placements, _with_dim(x.global_shape, dim, numel)
        )
        return ShardingDecision((target_x,), output)
    if index.ndim > 1:
        raise RuntimeError("index_select(): index must be a vector or a scalar")
    target_i = with_placements(index, [_index_placement(p) for p in index.placements])
    names = x.mesh.axis_names
    x_placements = list(target_x.placements)
    out: list[Placement] = list(target_x.placements)
    for axis, p in enumerate(target_i.placements):
        if isinstance(p, Shard):
            x_placements[axis] = Replicate()
            out[axis] = Shard(dim)
    order = [
        *target_i.shard_order,
        *(n for n in target_x.shard_order if n not in target_i.shard_order),
    ]
    target_x = with_placements(target_x, x_placements, shard_order=[n for n in order if n in names])
    numel = 1 if index.ndim == 0 else index.global_shape[0]
    shape = _with_dim(x.global_shape, dim, numel)
    output = with_placements(target_x, out, shape, shard_order=order)
    return ShardingDecision((target_x, target_i), output)


# tril / triu, roll, flip ------------------------------------------------------------------------


@register_sharding_rule(
    torch.tril,
    torch.Tensor.tril,
    torch.Tensor.tril_,
    torch.triu,
    torch.Tensor.triu,
    torch.Tensor.triu_,
)
def _tril_triu(call: OpCall) -> ShardingDecision:
    """``tril`` / ``triu(diagonal)``: every shard stays; the local call gets
    ``diagonal + row_offset - col_offset`` of the rank's block, which keeps exactly the
    elements the global op keeps."""
    layout = call.layouts[0]
    if layout.ndim < 2:
        raise RuntimeError(f"{call.name}: input tensor must have at least 2 dimensions")
    target = unshard_dims(layout, [])
    if call.inplace and target != layout:
        raise ShardingRuleError(
            f"in-place {call.name}_ on {layout!r} needs the RaggedShard gathered first; "
            f"use the out-of-place {call.name}"
        )
    diagonal = _as_int(call.arg(1, "diagonal", 0), call.name, "diagonal")
    offset = target.local_offset(call.rank) if target.numel else (0,) * layout.ndim
    local_diagonal = diagonal + offset[-2] - offset[-1]
    return ShardingDecision((target,), target, local_args=(target, local_diagonal), local_kwargs={})


def _dims_arg(value: Any, ndim: int, op: str) -> list[int]:
    items = [value] if isinstance(value, int) else list(value)
    return [normalize_dim(int(d), ndim, op) for d in items]


@register_sharding_rule(torch.roll, torch.Tensor.roll)
def _roll(call: OpCall) -> ShardingDecision:
    """``roll(shifts, dims)``: rolled dims are made Replicate (every dim without ``dims``, which
    rolls the flattening)."""
    layout = call.layouts[0]
    dims_value = call.arg(2, "dims", None)
    if dims_value is None or (isinstance(dims_value, list | tuple) and not dims_value):
        dims = list(range(layout.ndim))
    else:
        dims = _dims_arg(dims_value, layout.ndim, call.name)
    target = unshard_dims(layout, dims)
    return ShardingDecision((target,), target)


def _flip_decision(layout: Layout, dims: Sequence[int]) -> ShardingDecision:
    target = unshard_dims(layout, dims)
    return ShardingDecision((target,), target)


@register_sharding_rule(torch.flip, torch.Tensor.flip)
def _flip(call: OpCall) -> ShardingDecision:
    """``flip(dims)``: flipped dims are made Replicate."""
    layout = call.layouts[0]
    rest = tuple(call.args[1:]) or (call.kwargs.get("dims", ()),)
    values = rest[0] if len(rest) == 1 and not isinstance(rest[0], int) else rest
    return _flip_decision(layout, _dims_arg(values, layout.ndim, call.name))


@register_sharding_rule(torch.fliplr, torch.Tensor.fliplr)
def _fliplr(call: OpCall) -> ShardingDecision:
    """``fliplr``: flips dim 1."""
    layout = call.layouts[0]
    if layout.ndim < 2:
        raise RuntimeError("fliplr: input tensor must be >= 2-d")
    return _flip_decision(layout, [1])


@register_sharding_rule(torch.flipud, torch.Tensor.flipud)
def _flipud(call: OpCall) -> ShardingDecision:
    """``flipud``: flips dim 0."""
    layout = call.layouts[0]
    if layout.ndim < 1:
        raise RuntimeError("flipud: input tensor must be >= 1-d")
    return _flip_decision(layout, [0])


@register_sharding_rule(F.pad, torch.constant_pad_nd)
def _pad(call: OpCall) -> ShardingDecision:
    """``pad(input, pad, mode, value)``: padded dims (the last ``len(pad) // 2``) are made
    Replicate; a Partial input stays Partial only under zero constant padding (linear)."""
    layout = call.layouts[0]
    pad = call.arg(1, "pad")
    if isinstance(pad, Layout) or len(pad) % 2:
        raise ShardingRuleError(f"{call.name}: pad must be a sequence of ints of even length")
    count = len(pad) // 2
    if count > layout.ndim:
        raise RuntimeError(f"{call.name}: {len(pad)} pad entries for a {layout.ndim}-d tensor")
    dims = [layout.ndim - 1 - i for i in range(count)]
    mode = call.arg(2, "mode", "constant") if call.name == "pad" else "constant"
    value = call.arg(3, "value", None) if call.name == "pad" else call.arg(2, "value", 0)
    target = unshard_dims(layout, dims)
    if mode != "constant" or value not in (None, 0, 0.0):
        target = replicate_axes_where(target)
    shape = list(layout.global_shape)
    for i in range(count):
        d = layout.ndim - 1 - i
        shape[d] += int(pad[2 * i]) + int(pad[2 * i + 1])
    return ShardingDecision((target,), with_placements(target, target.placements, shape))
