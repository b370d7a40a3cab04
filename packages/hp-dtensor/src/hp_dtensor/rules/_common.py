"""Small helpers shared by the sharding rules."""

from __future__ import annotations

from collections.abc import Sequence

from hp_layout import Layout, Partial, Placement, ReduceOp, Replicate, Shard

__all__ = [
    "is_partial",
    "normalize_dim",
    "replicate_axes_where",
    "unshard_dims",
    "with_placements",
]


def normalize_dim(dim: int, ndim: int, op: str) -> int:
    """``dim`` in ``[0, ndim)``, or an IndexError naming the op."""
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"{op}: dim {dim} is out of range for a {ndim}-d tensor")
    return dim % max(ndim, 1)


def with_placements(
    layout: Layout,
    placements: Sequence[Placement],
    shape: Sequence[int] | None = None,
    shard_order: Sequence[str] | None = None,
) -> Layout:
    """``layout``'s mesh with new placements (and shape); keeps the shard order by default."""
    order = layout.shard_order if shard_order is None else shard_order
    names = layout.mesh.axis_names
    kept = [n for n in order if not isinstance(placements[names.index(n)], Replicate | Partial)]
    kept += [
        n for n, p in zip(names, placements, strict=True) if isinstance(p, Shard) and n not in kept
    ]
    new_shape = layout.global_shape if shape is None else tuple(shape)
    return Layout(new_shape, layout.mesh, placements, kept)


def is_partial(placement: Placement, *ops: ReduceOp) -> bool:
    """True for a Partial placement (with one of ``ops``, if given)."""
    return isinstance(placement, Partial) and (not ops or placement.op in ops)


def unshard_dims(layout: Layout, dims: Sequence[int]) -> Layout:
    """``layout`` with every axis sharding one of ``dims`` (or RaggedShard) made Replicate.

    Axes sharding the same dim *after* one of those are replicated too, since an outer
    shard cannot be undone while an inner one stays.
    """
    placements = list(layout.placements)
    names = layout.mesh.axis_names
    for d in dims:
        for name in layout.dim_sharding(d):
            placements[names.index(name)] = Replicate()
    if layout.ragged_axis is not None:
        placements[names.index(layout.ragged_axis)] = Replicate()
    return with_placements(layout, placements)


def replicate_axes_where(layout: Layout, partial: bool = True) -> Layout:
    """``layout`` with every Partial axis made Replicate (a reduction)."""
    placements = [
        Replicate() if partial and isinstance(p, Partial) else p for p in layout.placements
    ]
    return with_placements(layout, placements)
