"""Sharding rules for views and shape ops: reshapes, permutations, squeeze/unsqueeze, expand.

Every op here only rearranges (or repeats) elements, so it is exactly linear: a
``Partial`` axis passes through unchanged, whatever its reduction. What the rules decide is
where each ``Shard`` goes, and which shards must be undone first:

* **Permutations** (``transpose``/``swapaxes``/``swapdims``, ``permute``, ``t``, ``T``,
  ``mT``, ``H``, ``mH``, ``adjoint``, ``movedim``/``moveaxis``) renumber ``Shard`` dims; no
  data moves.
* **squeeze / unsqueeze** shift ``Shard`` dims. A squeezed size-1 dim that is sharded (one
  rank holds it, the others hold nothing) is made ``Replicate`` first.
* **expand / expand_as / broadcast_to** keep shards on dims that are not expanded and shift
  them by the number of new leading dims; an expanded size-1 dim that is sharded is made
  ``Replicate`` first.
* **view / reshape / view_as / reshape_as / flatten / unflatten** split old and new shapes
  into *groups*: the shortest runs of consecutive dims whose sizes have equal products. Each
  group is reshaped on its own (row-major order never crosses a group boundary). A sharded
  dim keeps its shard only when it is the first non-1 dim of its group and each rank's local
  chunk of it is exactly a ``torch.chunk`` chunk of the group's first non-1 *new* dim: for
  every coordinate of the sharding axes, ``[start, stop)`` on the old dim scaled by the
  product of the group's later old dims equals ``[start', stop')`` on the new dim scaled by
  the product of its later new dims. With nested shards (two axes on one dim) the longest
  prefix of the shard order that passes keeps its shards. Every shard that does not pass is
  redistributed to ``Replicate`` *before* the local reshape: an explicit, planned
  redistribution (an all-gather along that axis), never a silent result change. For even
  splits (``x.view(B * S, H)`` with ``B`` divisible by the axis) the shard always survives;
  ``S`` sharded, or ``B`` split unevenly, needs the gather. A ``RaggedShard`` (a flat-buffer
  shard of the row-major flattening) survives a reshape when it is the only sharding axis.

The local call always gets *local* sizes: the rules translate ``-1`` and global sizes into
the output layout's ``local_shape(rank)`` and pass them through ``local_func``. A local
``view`` whose strides do not allow a view (a shard made non-contiguous by a redistribution)
falls back to ``reshape``, i.e. copies.

In-place forms (``transpose_``, ``t_``, ``swapaxes_``, ``swapdims_``, ``squeeze_``,
``unsqueeze_``) cannot change a DTensor's global shape or layout; they are accepted only when
both stay the same, and raise ``ShardingRuleError`` otherwise. ``view(dtype)`` is rejected:
rules see layouts, not dtypes, so the output shape is unknown to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hp_dtensor.rules._common import normalize_dim, with_placements
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Placement, Replicate, Shard, chunk_bounds

__all__ = [
    "dim_groups",
    "expand_decision",
    "movedim_permutation",
    "permute_decision",
    "reshape_decision",
    "resolve_shape",
]

Group = tuple[tuple[int, ...], tuple[int, ...]]


# Argument parsing ---------------------------------------------------------------------------


def _ints(values: Sequence[Any], op: str) -> list[int]:
    out: list[int] = []
    for v in values:
        if isinstance(v, Layout):
            raise ShardingRuleError(f"{op}: sizes given as DTensors are not supported; pass ints")
        out.append(int(v))
    return out


def _varargs(call: OpCall, names: Sequence[str]) -> list[int]:
    """Sizes or dims given as ``f(x, 2, 3)``, ``f(x, (2, 3))`` or ``f(x, name=(2, 3))``."""
    rest: tuple[Any, ...] = tuple(call.args[1:])
    if not rest:
        for name in names:
            if name in call.kwargs:
                rest = (call.kwargs[name],)
                break
    if len(rest) == 1 and isinstance(rest[0], list | tuple | torch.Size):
        return _ints(rest[0], call.name)
    if len(rest) == 1 and isinstance(rest[0], torch.dtype):
        raise ShardingRuleError(
            f"{call.name}(dtype) on a DTensor is not supported: sharding rules see layouts, "
            "not dtypes, so the result shape is unknown to them; reinterpret the local "
            "tensor (to_local().view(dtype)) and wrap it with DTensor.from_local"
        )
    return _ints(rest, call.name)


def resolve_shape(sizes: Sequence[int], numel: int, op: str) -> tuple[int, ...]:
    """``sizes`` with its one ``-1`` inferred from ``numel`` (torch's rule); checked."""
    unknown = [i for i, n in enumerate(sizes) if n == -1]
    if len(unknown) > 1 or any(n < -1 for n in sizes):
        raise RuntimeError(f"{op}: invalid shape {list(sizes)}")
    known = math.prod(n for n in sizes if n != -1)
    out = list(sizes)
    if unknown:
        if known == 0 or numel % known:
            raise RuntimeError(f"{op}: shape {list(sizes)} is invalid for input of size {numel}")
        out[unknown[0]] = numel // known
    if math.prod(out) != numel:
        raise RuntimeError(f"{op}: shape {list(sizes)} is invalid for input of size {numel}")
    return tuple(out)


# Inplace guard and shared helpers -------------------------------------------------------------


def _decision(
    call: OpCall,
    layout: Layout,
    target: Layout,
    output: Layout,
    *,
    extra_inputs: Sequence[Layout] = (),
    local_args: tuple[Any, ...] | None = None,
    local_kwargs: Mapping[str, Any] | None = None,
    local_func: Callable[..., Any] | None = None,
) -> ShardingDecision:
    if call.inplace and (target != layout or output != layout):
        raise ShardingRuleError(
            f"in-place {call.name}_ would turn {layout!r} into {output!r}; a DTensor keeps its "
            f"global shape and layout in place, so use the out-of-place {call.name}"
        )
    return ShardingDecision(
        (target, *extra_inputs),
        output,
        local_args=local_args,
        local_kwargs=local_kwargs,
        local_func=local_func,
    )


def _replicate_axes(layout: Layout, axes: Sequence[str]) -> Layout:
    """``layout`` with the mesh axes ``axes`` made Replicate."""
    if not axes:
        return layout
    names = layout.mesh.axis_names
    placements = list(layout.placements)
    for name in axes:
        placements[names.index(name)] = Replicate()
    return with_placements(layout, placements)


def _without_ragged(layout: Layout) -> Layout:
    ragged = layout.ragged_axis
    return layout if ragged is None else _replicate_axes(layout, [ragged])


def _moved(layout: Layout, shape: Sequence[int], new_dim: Callable[[int], int]) -> Layout:
    """``layout`` (no RaggedShard) with each ``Shard(d)`` moved to ``Shard(new_dim(d))``."""
    placements: list[Placement] = [
        Shard(new_dim(p.dim)) if isinstance(p, Shard) else p for p in layout.placements
    ]
    return with_placements(layout, placements, shape)


# Permutations -----------------------------------------------------------------------------------


def _getter(name: str) -> Any:
    """The function ``__torch_function__`` sees for reading property ``Tensor.<name>``."""
    return getattr(torch.Tensor, name).__get__


def permute_decision(call: OpCall, perm: Sequence[int]) -> ShardingDecision:
    """Output dim ``i`` is input dim ``perm[i]``: shards are renumbered, Partial passes.

    A RaggedShard is gathered first (a permutation reorders the flattening it splits).
    """
    layout = call.layouts[0]
    target = _without_ragged(layout)
    shape = tuple(layout.global_shape[p] for p in perm)
    where = {src: dst for dst, src in enumerate(perm)}
    output = _moved(target, shape, where.__getitem__)
    return _decision(call, layout, target, output, extra_inputs=call.layouts[1:])


def _swap(ndim: int, a: int, b: int) -> list[int]:
    perm = list(range(ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


@register_sharding_rule(
    torch.transpose,
    torch.Tensor.transpose,
    torch.Tensor.transpose_,
    torch.swapaxes,
    torch.Tensor.swapaxes,
    torch.Tensor.swapaxes_,
    torch.swapdims,
    torch.Tensor.swapdims,
    torch.Tensor.swapdims_,
)
def _transpose(call: OpCall) -> ShardingDecision:
    """``transpose(dim0, dim1)``: the two dims trade places (and their shards)."""
    ndim = call.layouts[0].ndim
    first = call.arg(1, "dim0", call.kwargs.get("axis0"))
    second = call.arg(2, "dim1", call.kwargs.get("axis1"))
    a = normalize_dim(int(first), ndim, call.name)
    b = normalize_dim(int(second), ndim, call.name)
    return permute_decision(call, _swap(ndim, a, b))


@register_sharding_rule(torch.permute, torch.Tensor.permute)
def _permute(call: OpCall) -> ShardingDecision:
    """``permute(dims)``: output dim ``i`` is input dim ``dims[i]``."""
    ndim = call.layouts[0].ndim
    dims = [normalize_dim(d, ndim, call.name) for d in _varargs(call, ("dims",))]
    if sorted(dims) != list(range(ndim)):
        raise RuntimeError(f"permute: {dims} is not a permutation of the {ndim} dims")
    return permute_decision(call, dims)


@register_sharding_rule(torch.t, torch.Tensor.t, torch.Tensor.t_)
def _t(call: OpCall) -> ShardingDecision:
    """``t()``: swaps the two dims of a 2-d tensor; identity below 2-d."""
    ndim = call.layouts[0].ndim
    if ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dims, got {ndim}")
    return permute_decision(call, list(range(ndim))[::-1])


@register_sharding_rule(_getter("T"), _getter("H"))
def _reverse(call: OpCall) -> ShardingDecision:
    """``T`` / ``H``: all dims reversed (``H`` also conjugates, which is linear)."""
    return permute_decision(call, list(range(call.layouts[0].ndim))[::-1])


@register_sharding_rule(
    _getter("mT"),
    _getter("mH"),
    torch.adjoint,
    torch.Tensor.adjoint,
)
def _matrix_transpose(call: OpCall) -> ShardingDecision:
    """``mT`` / ``mH`` / ``adjoint``: the last two dims swapped (``mH`` also conjugates)."""
    ndim = call.layouts[0].ndim
    if ndim < 2:
        raise RuntimeError(f"{call.name}: expected a tensor with >= 2 dims, got {ndim}")
    return permute_decision(call, _swap(ndim, ndim - 2, ndim - 1))


def movedim_permutation(ndim: int, source: Sequence[int], destination: Sequence[int]) -> list[int]:
    """``perm`` with ``perm[i]`` the input dim that ``movedim`` puts at output dim ``i``."""
    if len(source) != len(destination):
        raise RuntimeError("movedim: source and destination need the same number of dims")
    perm = [-1] * ndim
    for s, d in zip(source, destination, strict=True):
        perm[d] = s
    rest = iter(d for d in range(ndim) if d not in source)
    return [p if p >= 0 else next(rest) for p in perm]


@register_sharding_rule(torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis)
def _movedim(call: OpCall) -> ShardingDecision:
    """``movedim(source, destination)``: dims move, the others keep their order."""
    ndim = call.layouts[0].ndim
    src = call.arg(1, "source")
    dst = call.arg(2, "destination")
    srcs = [src] if isinstance(src, int) else list(src)
    dsts = [dst] if isinstance(dst, int) else list(dst)
    source = [normalize_dim(int(d), ndim, call.name) for d in srcs]
    destination = [normalize_dim(int(d), ndim, call.name) for d in dsts]
    return permute_decision(call, movedim_permutation(ndim, source, destination))


# squeeze / unsqueeze ----------------------------------------------------------------------------


def _squeezed_dims(call: OpCall, layout: Layout) -> tuple[int, ...]:
    dim = call.arg(1, "dim", None)
    shape = layout.global_shape
    if dim is None:
        candidates: list[int] = list(range(layout.ndim))
    elif isinstance(dim, int):
        candidates = [normalize_dim(dim, layout.ndim, call.name)]
    else:
        candidates = [normalize_dim(int(d), layout.ndim, call.name) for d in dim]
    return tuple(sorted({d for d in candidates if shape[d] == 1}))


def _squeeze_local(dims: tuple[int, ...], inplace: bool) -> Callable[..., torch.Tensor]:
    def squeeze_local(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        if inplace:
            return x.squeeze_(dims) if dims else x
        return torch.squeeze(x, dims)

    return squeeze_local


@register_sharding_rule(torch.squeeze, torch.Tensor.squeeze, torch.Tensor.squeeze_)
def _squeeze(call: OpCall) -> ShardingDecision:
    """``squeeze(dim=None)``: removes the named (or all) *global* size-1 dims.

    A sharded size-1 dim is made Replicate first; the local call names the dims explicitly,
    since a shard may be size 1 locally where the global dim is not.
    """
    layout = call.layouts[0]
    dims = _squeezed_dims(call, layout)
    target = _replicate_axes(
        _without_ragged(layout), [n for d in dims for n in layout.dim_sharding(d)]
    )
    shape = tuple(n for d, n in enumerate(layout.global_shape) if d not in dims)
    output = _moved(target, shape, lambda d: d - sum(1 for s in dims if s < d))
    return _decision(call, layout, target, output, local_func=_squeeze_local(dims, call.inplace))


@register_sharding_rule(torch.unsqueeze, torch.Tensor.unsqueeze, torch.Tensor.unsqueeze_)
def _unsqueeze(call: OpCall) -> ShardingDecision:
    """``unsqueeze(dim)``: a new size-1 dim; shards at or after it shift by one."""
    layout = call.layouts[0]
    dim = normalize_dim(int(call.arg(1, "dim")), layout.ndim + 1, call.name)
    target = _without_ragged(layout)
    shape = (*layout.global_shape[:dim], 1, *layout.global_shape[dim:])
    output = _moved(target, shape, lambda d: d + (d >= dim))
    return _decision(call, layout, target, output)


# expand -----------------------------------------------------------------------------------------


def _expand_local(shape: tuple[int, ...]) -> Callable[..., torch.Tensor]:
    def expand_local(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return x.expand(shape)

    return expand_local


def expand_decision(call: OpCall, sizes: Sequence[int]) -> ShardingDecision:
    """Expand ``call``'s first DTensor to ``sizes`` (``-1`` keeps a dim).

    Shards on dims that keep their size survive (shifted by the new leading dims); an
    expanded size-1 dim that is sharded is made Replicate first. Partial passes.
    """
    layout = call.layouts[0]
    old = layout.global_shape
    offset = len(sizes) - len(old)
    if offset < 0:
        raise RuntimeError(
            f"{call.name}: the number of sizes {list(sizes)} must be >= the number of dims "
            f"{len(old)}"
        )
    shape = tuple((old[k - offset] if n == -1 and k >= offset else n) for k, n in enumerate(sizes))
    for k in range(offset, len(shape)):
        if old[k - offset] != shape[k] and old[k - offset] != 1:
            raise RuntimeError(
                f"{call.name}: cannot expand size {old[k - offset]} at dim {k - offset} to "
                f"{shape[k]} (target sizes {list(sizes)})"
            )
    if any(n < 0 for n in shape):
        raise RuntimeError(f"{call.name}: invalid sizes {list(sizes)}")
    expanded = [d for d in range(len(old)) if old[d] != shape[d + offset]]
    target = _replicate_axes(
        _without_ragged(layout), [n for d in expanded for n in layout.dim_sharding(d)]
    )
    output = _moved(target, shape, lambda d: d + offset)
    local = _expand_local(output.local_shape(call.rank))
    return _decision(call, layout, target, output, extra_inputs=call.layouts[1:], local_func=local)


@register_sharding_rule(torch.Tensor.expand)
def _expand(call: OpCall) -> ShardingDecision:
    """``expand(*sizes)``."""
    return expand_decision(call, _varargs(call, ("size",)))


@register_sharding_rule(torch.broadcast_to, torch.Tensor.broadcast_to)
def _broadcast_to(call: OpCall) -> ShardingDecision:
    """``broadcast_to(shape)``: ``expand`` to ``shape``."""
    return expand_decision(call, _varargs(call, ("size", "shape")))


@register_sharding_rule(torch.Tensor.expand_as)
def _expand_as(call: OpCall) -> ShardingDecision:
    """``expand_as(other)``: ``other`` only gives the shape; its data stays where it is."""
    return expand_decision(call, call.layouts[1].global_shape)


# view / reshape ---------------------------------------------------------------------------------


def dim_groups(old: Sequence[int], new: Sequence[int]) -> list[Group]:
    """Split two shapes of equal, non-zero numel into the shortest runs of consecutive dims
    with equal products; size-1 dims join the run they are scanned into (trailing ones form
    runs of their own, possibly with an empty side)."""
    groups: list[Group] = []
    i = j = 0
    while i < len(old) or j < len(new):
        olds: list[int] = []
        news: list[int] = []
        p = q = 1
        if i < len(old):
            olds.append(i)
            p *= old[i]
            i += 1
        if j < len(new):
            news.append(j)
            q *= new[j]
            j += 1
        while p != q:
            if p < q:
                olds.append(i)
                p *= old[i]
                i += 1
            else:
                news.append(j)
                q *= new[j]
                j += 1
        groups.append((tuple(olds), tuple(news)))
    return groups


def _leading(dims: Sequence[int], shape: Sequence[int]) -> int | None:
    """The first dim of ``dims`` with size != 1 (the first dim if all are 1; None if empty)."""
    for d in dims:
        if shape[d] != 1:
            return d
    return dims[0] if dims else None


def _nested_intervals(length: int, parts: Sequence[int]) -> list[tuple[int, int]]:
    """``torch.chunk`` intervals of ``length`` split by ``parts[0]``, each by ``parts[1]``..."""
    found = [(0, length)]
    for n in parts:
        found = [
            (start + lo, start + hi)
            for start, stop in found
            for lo, hi in (chunk_bounds(stop - start, n, k) for k in range(n))
        ]
    return found


def _kept_prefix(parts: Sequence[int], old: int, old_scale: int, new: int, new_scale: int) -> int:
    """How many of the nested splits ``parts`` of an old dim carry over to the new dim.

    A prefix carries over when every rank's chunk of the old dim, flattened with the group's
    later old dims (``old_scale``), is the same flat range as its chunk of the new dim
    flattened with the group's later new dims (``new_scale``).
    """
    for k in range(len(parts), 0, -1):
        before = _nested_intervals(old, parts[:k])
        after = _nested_intervals(new, parts[:k])
        if all(
            (a * old_scale, b * old_scale) == (c * new_scale, d * new_scale)
            for (a, b), (c, d) in zip(before, after, strict=True)
        ):
            return k
    return 0


def _reshape_ragged(layout: Layout, shape: tuple[int, ...]) -> tuple[Layout, Layout]:
    if any(isinstance(p, Shard) for p in layout.placements):
        return _reshape_layouts(_without_ragged(layout), shape)
    return layout, Layout(shape, layout.mesh, layout.placements, layout.shard_order)


def _reshape_layouts(layout: Layout, shape: tuple[int, ...]) -> tuple[Layout, Layout]:
    """(input target, output) layouts of reshaping ``layout`` to ``shape``."""
    if layout.ragged_axis is not None:
        return _reshape_ragged(layout, shape)
    names = layout.mesh.axis_names
    old = layout.global_shape
    source: list[Placement] = list(layout.placements)
    out: list[Placement] = [Replicate() if isinstance(p, Shard) else p for p in source]
    groups = dim_groups(old, shape) if layout.numel else [(tuple(range(len(old))), ())]
    for olds, news in groups:
        lead_old = _leading(olds, old)
        lead_new = _leading(news, shape)
        total = math.prod(old[d] for d in olds)
        for d in olds:
            axes = layout.dim_sharding(d)
            keep = 0
            if axes and d == lead_old and lead_new is not None:
                parts = [layout.mesh.axis_size(n) for n in axes]
                keep = _kept_prefix(
                    parts, old[d], total // old[d], shape[lead_new], total // shape[lead_new]
                )
            for name in axes[keep:]:
                source[names.index(name)] = Replicate()
            for name in axes[:keep]:
                assert lead_new is not None
                out[names.index(name)] = Shard(lead_new)
    target = with_placements(layout, source)
    return target, with_placements(target, out, shape)


def _reshape_local(shape: tuple[int, ...], try_view: bool) -> Callable[..., torch.Tensor]:
    def reshape_local(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        if try_view:
            try:
                return x.view(shape)
            except RuntimeError:
                pass
        return x.reshape(shape)

    return reshape_local


def reshape_decision(call: OpCall, shape: Sequence[int], try_view: bool) -> ShardingDecision:
    """Reshape ``call``'s first DTensor to the global ``shape`` (``-1`` allowed).

    See the module docstring for which shards survive; the others are redistributed to
    Replicate first. Extra DTensor arguments (``view_as``'s ``other``) keep their layout.
    """
    layout = call.layouts[0]
    resolved = resolve_shape(shape, layout.numel, call.name)
    target, output = _reshape_layouts(layout, resolved)
    local = _reshape_local(output.local_shape(call.rank), try_view)
    return _decision(call, layout, target, output, extra_inputs=call.layouts[1:], local_func=local)


@register_sharding_rule(torch.Tensor.view)
def _view(call: OpCall) -> ShardingDecision:
    """``view(*shape)``."""
    return reshape_decision(call, _varargs(call, ("size",)), try_view=True)


@register_sharding_rule(torch.reshape, torch.Tensor.reshape)
def _reshape(call: OpCall) -> ShardingDecision:
    """``reshape(*shape)``."""
    return reshape_decision(call, _varargs(call, ("shape",)), try_view=False)


@register_sharding_rule(torch.Tensor.view_as)
def _view_as(call: OpCall) -> ShardingDecision:
    """``view_as(other)``: ``view(other.shape)``."""
    return reshape_decision(call, call.layouts[1].global_shape, try_view=True)


@register_sharding_rule(torch.Tensor.reshape_as)
def _reshape_as(call: OpCall) -> ShardingDecision:
    """``reshape_as(other)``: ``reshape(other.shape)``."""
    return reshape_decision(call, call.layouts[1].global_shape, try_view=False)


@register_sharding_rule(torch.flatten, torch.Tensor.flatten)
def _flatten(call: OpCall) -> ShardingDecision:
    """``flatten(start_dim=0, end_dim=-1)``: a reshape merging the dims in between."""
    layout = call.layouts[0]
    old = layout.global_shape
    if layout.ndim == 0:
        return reshape_decision(call, (1,), try_view=False)
    start = normalize_dim(int(call.arg(1, "start_dim", 0)), layout.ndim, call.name)
    end = normalize_dim(int(call.arg(2, "end_dim", -1)), layout.ndim, call.name)
    if start > end:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    shape = (*old[:start], math.prod(old[start : end + 1]), *old[end + 1 :])
    return reshape_decision(call, shape, try_view=False)


@register_sharding_rule(torch.unflatten, torch.Tensor.unflatten)
def _unflatten(call: OpCall) -> ShardingDecision:
    """``unflatten(dim, sizes)``: a reshape splitting ``dim`` into ``sizes``."""
    layout = call.layouts[0]
    old = layout.global_shape
    dim = normalize_dim(int(call.arg(1, "dim")), layout.ndim, call.name)
    sizes = resolve_shape(_ints(call.arg(2, "sizes"), call.name), old[dim], call.name)
    return reshape_decision(call, (*old[:dim], *sizes, *old[dim + 1 :]), try_view=False)
