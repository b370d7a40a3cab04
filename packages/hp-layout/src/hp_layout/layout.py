"""Layout: a global tensor shape distributed over a mesh by one placement per mesh axis.

Sharding axes are applied one after another in ``shard_order``. Each :class:`Shard` axis
splits the current extent of its tensor dimension with ``torch.chunk`` semantics, so two axes
sharding the same dimension nest: the later one splits each piece the earlier one made.
A :class:`RaggedShard` axis always comes last: it splits the row-major flattening of the box
the other shards leave. :class:`Replicate` and :class:`Partial` axes do not change which
elements a rank holds.

A layout is immutable and hashable; equality is semantic (``shard_order`` is canonicalized so
that two layouts that nest the same axes in the same order compare equal however the order
was written). Every query is pure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from hp_layout.chunking import chunk_bounds, chunk_length
from hp_layout.errors import PlacementError
from hp_layout.mesh import Mesh
from hp_layout.placement import Partial, Placement, RaggedShard, Replicate, Shard, is_sharding
from hp_layout.region import Box, Region, box_numel

__all__ = ["Layout"]


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    out = tuple(shape)
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PlacementError(f"a global shape needs non-negative int sizes, got {out}")
    return out


class Layout:
    """``global_shape`` distributed over ``mesh`` with one placement per mesh axis.

    Args:
        global_shape: the full tensor's shape (any rank, zero sizes allowed).
        mesh: the mesh the tensor lives on.
        placements: one placement per mesh axis, in mesh axis order.
        shard_order: mesh axis names in the order their sharding applies; only the relative
            order of axes sharding the same tensor dimension matters. Defaults to mesh axis
            order (a ``RaggedShard`` axis is always last). Non-sharding axes may be listed
            and are ignored.

    Raises:
        PlacementError: when a placement does not fit the tensor or the mesh.
    """

    global_shape: tuple[int, ...]
    mesh: Mesh
    placements: tuple[Placement, ...]
    shard_order: tuple[str, ...]
    _hash: int

    def __init__(
        self,
        global_shape: Sequence[int],
        mesh: Mesh,
        placements: Sequence[Placement],
        shard_order: Sequence[str] | None = None,
    ) -> None:
        shape = _check_shape(global_shape)
        if not isinstance(mesh, Mesh):
            raise PlacementError(f"a layout needs an hp_layout.Mesh, got {type(mesh).__name__}")
        given = tuple(placements)
        if len(given) != mesh.ndim:
            raise PlacementError(
                f"{mesh!r} has {mesh.ndim} axes but {len(given)} placements {list(given)} were "
                "given; give one placement per mesh axis"
            )
        normalized = tuple(
            self._normalize(p, shape, name) for p, name in zip(given, mesh.axis_names, strict=True)
        )
        ops = {p.op for p in normalized if isinstance(p, Partial)}
        if len(ops) > 1:
            raise PlacementError(
                f"placements {list(normalized)} mix Partial reductions "
                f"{sorted(o.value for o in ops)};"
                " the value of such a layout depends on the reduction order, so every Partial "
                "axis of one layout must use the same op"
            )
        ragged = [i for i, p in enumerate(normalized) if isinstance(p, RaggedShard)]
        if len(ragged) > 1:
            names = [mesh.axis_names[i] for i in ragged]
            raise PlacementError(f"at most one mesh axis may be RaggedShard, got {names}")
        order = self._resolve_order(mesh, normalized, shard_order)
        dim_axes = tuple(
            tuple(i for i in order if normalized[i] == Shard(d)) for d in range(len(shape))
        )
        canonical = tuple(i for d in range(len(shape)) for i in dim_axes[d]) + tuple(ragged)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", normalized)
        object.__setattr__(self, "shard_order", tuple(mesh.axis_names[i] for i in canonical))
        object.__setattr__(self, "_dim_axes", dim_axes)
        object.__setattr__(self, "_ragged_axis", ragged[0] if ragged else None)
        object.__setattr__(self, "_hash", hash((shape, mesh, normalized, self.shard_order)))
        if ragged:
            self._check_ragged(ragged[0])

    # Construction helpers ---------------------------------------------------------------------

    @staticmethod
    def _normalize(placement: Placement, shape: tuple[int, ...], axis: str) -> Placement:
        if isinstance(placement, Shard):
            ndim = len(shape)
            if not -ndim <= placement.dim < ndim:
                valid = f"[{-ndim}, {ndim})" if ndim else "none (the tensor is 0-d)"
                raise PlacementError(
                    f"Shard({placement.dim}) on mesh axis {axis!r} is out of range for a "
                    f"{ndim}-d tensor of shape {shape}; valid dims are {valid}"
                )
            return Shard(placement.dim % ndim)
        if isinstance(placement, Replicate | Partial | RaggedShard):
            return placement
        raise PlacementError(
            f"mesh axis {axis!r} has {placement!r}, which is not a placement; use Shard, "
            "Replicate, Partial or RaggedShard"
        )

    @staticmethod
    def _resolve_order(
        mesh: Mesh, placements: tuple[Placement, ...], shard_order: Sequence[str] | None
    ) -> tuple[int, ...]:
        sharding = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
        ragged = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
        if shard_order is None:
            return tuple(sharding + ragged)
        if isinstance(shard_order, str):
            raise PlacementError(
                f"shard_order must be a sequence of axis names, got {shard_order!r}"
            )
        named = [mesh.axis_index(name) for name in shard_order]
        if len(set(named)) != len(named):
            raise PlacementError(f"shard_order {list(shard_order)} names an axis twice")
        order = [i for i in named if is_sharding(placements[i])]
        missing = [mesh.axis_names[i] for i in sharding + ragged if i not in order]
        if missing:
            raise PlacementError(
                f"shard_order {list(shard_order)} must list every sharding axis; missing {missing}"
            )
        if ragged and order[-1] != ragged[0]:
            later = [mesh.axis_names[i] for i in order[order.index(ragged[0]) + 1 :]]
            raise PlacementError(
                f"RaggedShard on mesh axis {mesh.axis_names[ragged[0]]!r} must be the last "
                f"sharding applied, but shard_order puts {later} after it"
            )
        return tuple(order)

    def _check_ragged(self, axis: int) -> None:
        placement = self.placements[axis]
        assert isinstance(placement, RaggedShard)
        name = self.mesh.axis_names[axis]
        if len(placement.local_numels) != self.mesh.shape[axis]:
            raise PlacementError(
                f"{placement!r} on mesh axis {name!r} has {len(placement.local_numels)} entries; "
                f"the axis has size {self.mesh.shape[axis]}, give one entry per coordinate"
            )
        per_dim = [set(counts) for counts in self._dim_length_counts]
        if all(len(lengths) == 1 for lengths in per_dim):
            block_numels = {math.prod(next(iter(lengths)) for lengths in per_dim)}
        elif any(lengths == {0} for lengths in per_dim):
            block_numels = {0}
        else:
            block_numels = {math.prod(c) for c in itertools.product(*per_dim)}
        if len(block_numels) > 1:
            raise PlacementError(
                f"{placement!r} on mesh axis {name!r} splits the block the other shards leave, "
                f"which holds different numbers of elements {sorted(block_numels)} at different "
                "coordinates; RaggedShard needs the same block size everywhere (shard evenly first)"
            )
        (block,) = block_numels
        if sum(placement.local_numels) != block:
            raise PlacementError(
                f"{placement!r} on mesh axis {name!r} covers {sum(placement.local_numels)} "
                f"elements but the block it splits holds {block} (shape {self.global_shape}); "
                "local_numels must sum to the block's numel"
            )

    @cached_property
    def _dim_length_counts(self) -> tuple[dict[int, int], ...]:
        counts: list[dict[int, int]] = []
        for dim, axes in enumerate(self._dim_axes):
            found = {self.global_shape[dim]: 1}
            for axis in axes:
                parts = self.mesh.shape[axis]
                split: dict[int, int] = {}
                for length, count in found.items():
                    for index in range(parts):
                        piece = chunk_length(length, parts, index)
                        split[piece] = split.get(piece, 0) + count
                found = split
            counts.append(found)
        return tuple(counts)

    def dim_length_counts(self, dim: int) -> dict[int, int]:
        """How many coordinates of the axes sharding ``dim`` give each local extent of ``dim``.

        The keys are the distinct extents (nested ``torch.chunk`` splits give few); the counts
        sum to the product of the sizes of the axes sharding ``dim``.
        """
        return dict(self._dim_length_counts[dim])

    # Value semantics --------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Layout is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.global_shape == other.global_shape
            and self.placements == other.placements
            and self.shard_order == other.shard_order
            and self.mesh == other.mesh
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (Layout, (self.global_shape, self.mesh, self.placements, self.shard_order))

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}: {p!r}" for n, p in zip(self.mesh.axis_names, self.placements, strict=True)
        )
        nested = any(len(axes) > 1 for axes in self._dim_axes)
        order = f", shard_order={list(self.shard_order)}" if nested else ""
        return f"Layout({list(self.global_shape)}, {{{parts}}}{order})"

    def with_placements(
        self, placements: Sequence[Placement], shard_order: Sequence[str] | None = None
    ) -> Layout:
        """The same shape and mesh with other placements."""
        return Layout(self.global_shape, self.mesh, placements, shard_order)

    # Derived structure ------------------------------------------------------------------------

    _dim_axes: tuple[tuple[int, ...], ...]
    _ragged_axis: int | None

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.global_shape)

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        return math.prod(self.global_shape)

    def dim_sharding(self, dim: int) -> tuple[str, ...]:
        """Names of the mesh axes sharding tensor dimension ``dim``, in the order they apply."""
        return tuple(self.mesh.axis_names[a] for a in self._dim_axes[dim])

    @property
    def ragged_axis(self) -> str | None:
        """Name of the RaggedShard axis, if any."""
        return None if self._ragged_axis is None else self.mesh.axis_names[self._ragged_axis]

    def placement(self, axis: str | int) -> Placement:
        """The placement on mesh axis ``axis``."""
        return self.placements[self.mesh.axis_index(axis)]

    def _axes_where(self, kind: type[Any] | tuple[type[Any], ...]) -> tuple[str, ...]:
        return tuple(
            n
            for n, p in zip(self.mesh.axis_names, self.placements, strict=True)
            if isinstance(p, kind)
        )

    @cached_property
    def sharded_axes(self) -> tuple[str, ...]:
        """Axes with Shard or RaggedShard, in mesh order."""
        return self._axes_where((Shard, RaggedShard))

    @cached_property
    def replicated_axes(self) -> tuple[str, ...]:
        """Axes with Replicate, in mesh order."""
        return self._axes_where(Replicate)

    @cached_property
    def partial_axes(self) -> tuple[str, ...]:
        """Axes with Partial, in mesh order."""
        return self._axes_where(Partial)

    @property
    def is_replicated(self) -> bool:
        """True when every rank holds the whole, final value (every axis Replicate)."""
        return len(self.replicated_axes) == self.mesh.ndim

    @property
    def is_sharded(self) -> bool:
        """True when some axis splits the tensor."""
        return bool(self.sharded_axes)

    @property
    def has_partial(self) -> bool:
        """True when some axis holds partial values awaiting a reduction."""
        return bool(self.partial_axes)

    # Per-rank queries -------------------------------------------------------------------------

    def dim_interval(self, dim: int, coordinate: Sequence[int]) -> tuple[int, int]:
        """``(start, stop)`` along tensor dim ``dim`` of the box held at mesh ``coordinate``."""
        start, stop = 0, self.global_shape[dim]
        for axis in self._dim_axes[dim]:
            lo, hi = chunk_bounds(stop - start, self.mesh.shape[axis], coordinate[axis])
            start, stop = start + lo, start + hi
        return start, stop

    def region_at(self, coordinate: Sequence[int]) -> Region:
        """The region held at mesh ``coordinate``."""
        box: Box = tuple(self.dim_interval(d, coordinate) for d in range(self.ndim))
        if self._ragged_axis is None:
            return Region(box)
        ragged = self.placements[self._ragged_axis]
        assert isinstance(ragged, RaggedShard)
        offsets = ragged.offsets
        index = coordinate[self._ragged_axis]
        return Region(box, (offsets[index], offsets[index + 1]))

    def local_region(self, rank: int) -> Region:
        """The region of the global tensor that ``rank`` holds.

        Postconditions: over the ranks of one :meth:`shard_group`, the regions are disjoint
        and their union is the whole tensor.
        """
        return self.region_at(self.mesh.coordinate(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of the local data of ``rank`` (1-D after a RaggedShard)."""
        return self.local_region(rank).shape

    def local_offset(self, rank: int) -> tuple[int, ...]:
        """Global index of the first element of ``rank``'s box (as torch DTensor reports it)."""
        return self.local_region(rank).offset

    def local_numel(self, rank: int) -> int:
        """Number of elements ``rank`` holds."""
        return self.local_region(rank).numel

    def total_local_numel(self) -> int:
        """Sum over all ranks of the elements each holds (exact for uneven shards too).

        Shards along the sharding axes tile the tensor, so the sum is the global numel times
        the number of ranks that hold each element once: the product of the non-sharding
        axis sizes.
        """
        copies = math.prod(
            n for n, p in zip(self.mesh.shape, self.placements, strict=True) if not is_sharding(p)
        )
        return self.numel * copies

    def ranks_holding(self, box: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Ranks (in mesh order) that hold at least one element of ``box``."""
        target = tuple((int(a), int(b)) for a, b in box)
        if len(target) != self.ndim:
            raise PlacementError(f"box {target} has {len(target)} dims; the tensor has {self.ndim}")
        for d, ((a, b), n) in enumerate(zip(target, self.global_shape, strict=True)):
            if not 0 <= a <= b <= n:
                raise PlacementError(f"box interval {(a, b)} of dim {d} is outside [0, {n}]")
        if box_numel(target) == 0:
            return ()
        return tuple(r for r in self.mesh.ranks if self.local_region(r).intersects(target))

    # Groups -----------------------------------------------------------------------------------

    def shard_group(self, rank: int) -> tuple[int, ...]:
        """Ranks that hold the other pieces of ``rank``'s copy (varying the sharding axes)."""
        return self.mesh.group_of(rank, self.sharded_axes)

    def replica_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding exactly what ``rank`` holds (varying the Replicate axes)."""
        return self.mesh.group_of(rank, self.replicated_axes)

    def partial_group(self, rank: int) -> tuple[int, ...]:
        """Ranks whose partial values combine with ``rank``'s (varying the Partial axes)."""
        return self.mesh.group_of(rank, self.partial_axes)

    def whole_tensor_groups(self) -> tuple[tuple[int, ...], ...]:
        """Disjoint rank groups that each hold, among their members, the whole final value.

        Each group varies the sharding and Partial axes; there is one group per coordinate of
        the Replicate axes, and each group's ranks are exactly the candidates to own (gather,
        compute on, scatter back) the tensor for its replica.
        """
        return self.mesh.groups(self.sharded_axes + self.partial_axes)

    def owner_candidates(self, rank: int) -> tuple[int, ...]:
        """The whole-tensor group containing ``rank`` (see :meth:`whole_tensor_groups`)."""
        return self.mesh.group_of(rank, self.sharded_axes + self.partial_axes)
