"""Mesh: named axes over an explicit grid of ranks.

The grid may hold any ranks in any order (a mesh over ranks ``[6, 2, 7, 3]`` is legal), so a
mesh can describe a sub-mesh of a larger job or a topology-aware rank order. Equality and
hash cover the axis names, the shape and the whole rank grid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

from hp_layout.errors import MeshError

__all__ = ["Mesh"]


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def _iter_coords(shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in shape))


class Mesh:
    """Named axes of given sizes over a row-major grid of ranks.

    Args:
        shape: size of each axis (all positive).
        axis_names: one unique, non-empty name per axis.
        ranks: the rank grid flattened row-major (last axis fastest); defaults to
            ``range(prod(shape))``. Ranks are unique non-negative ints, in any order.

    Raises:
        MeshError: when the names, sizes and ranks do not agree.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    ranks: tuple[int, ...]
    _hash: int

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        ranks: Sequence[int] | None = None,
    ) -> None:
        shape_t = tuple(shape)
        names_t = tuple(axis_names)
        if len(shape_t) != len(names_t):
            raise MeshError(
                f"mesh shape {shape_t} has {len(shape_t)} axes but {len(names_t)} names "
                f"{names_t} were given; give one name per axis"
            )
        for size in shape_t:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis sizes must be positive ints, got shape {shape_t}")
        for name in names_t:
            if not isinstance(name, str) or not name:
                raise MeshError(f"mesh axis names must be non-empty strings, got {names_t}")
        if len(set(names_t)) != len(names_t):
            raise MeshError(f"mesh axis names must be unique, got {names_t}")
        count = math.prod(shape_t)
        ranks_t = tuple(range(count)) if ranks is None else tuple(ranks)
        if len(ranks_t) != count:
            raise MeshError(
                f"a mesh of shape {shape_t} needs {count} ranks, got {len(ranks_t)}: {ranks_t}"
            )
        for r in ranks_t:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise MeshError(f"ranks must be non-negative ints, got {r!r} in {ranks_t}")
        if len(set(ranks_t)) != count:
            dupes = sorted({r for r in ranks_t if ranks_t.count(r) > 1})
            raise MeshError(f"ranks must be unique in a mesh, got duplicates {dupes}")
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "axis_names", names_t)
        object.__setattr__(self, "ranks", ranks_t)
        object.__setattr__(self, "_hash", hash((shape_t, names_t, ranks_t)))

    # Immutability and value semantics -------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Mesh is immutable; cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Mesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.axis_names == other.axis_names
            and self.ranks == other.ranks
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (Mesh, (self.shape, self.axis_names, self.ranks))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        if self.ranks == tuple(range(self.size)):
            return f"Mesh({axes})"
        return f"Mesh({axes}, ranks={list(self.ranks)})"

    # Construction ---------------------------------------------------------------------------

    @classmethod
    def from_grid(cls, grid: Any, axis_names: Sequence[str]) -> Mesh:
        """Build a mesh from a nested list of ranks, e.g. ``[[0, 2], [1, 3]]``.

        The nesting depth must equal ``len(axis_names)`` and every level must be rectangular.
        """
        shape: list[int] = []
        level = grid
        for _ in axis_names:
            if not isinstance(level, Sequence) or isinstance(level, str) or not level:
                raise MeshError(f"rank grid {grid!r} is not nested {len(axis_names)} levels deep")
            shape.append(len(level))
            level = level[0]
        flat: list[int] = []

        def walk(node: Any, depth: int) -> None:
            if depth == len(shape):
                flat.append(node)
                return
            if not isinstance(node, Sequence) or len(node) != shape[depth]:
                raise MeshError(f"rank grid {grid!r} is not rectangular with shape {shape}")
            for child in node:
                walk(child, depth + 1)

        walk(grid, 0)
        return cls(shape, axis_names, flat)

    # Basic queries --------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        return _row_major_strides(self.shape)

    @cached_property
    def _position(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.ranks)}

    def axis_index(self, axis: str | int) -> int:
        """Index of ``axis`` (a name, or an index that is checked)."""
        if isinstance(axis, int) and not isinstance(axis, bool):
            if not -self.ndim <= axis < self.ndim:
                raise MeshError(f"mesh axis index {axis} is out of range for {self!r}")
            return axis % self.ndim
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise MeshError(
                f"unknown mesh axis {axis!r}; this mesh has axes {list(self.axis_names)}"
            ) from None

    def axis_size(self, axis: str | int) -> int:
        """Size of ``axis``."""
        return self.shape[self.axis_index(axis)]

    def __contains__(self, rank: object) -> bool:
        return rank in self._position

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Coordinate of ``rank`` in the grid, one index per axis."""
        try:
            position = self._position[rank]
        except KeyError:
            raise MeshError(f"rank {rank} is not in {self!r}") from None
        return tuple((position // s) % n for s, n in zip(self._strides, self.shape, strict=True))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """Rank at ``coordinate`` (one index per axis)."""
        if len(coordinate) != self.ndim or any(
            not 0 <= c < n for c, n in zip(coordinate, self.shape, strict=True)
        ):
            raise MeshError(f"coordinate {tuple(coordinate)} is outside mesh shape {self.shape}")
        return self.ranks[sum(c * s for c, s in zip(coordinate, self._strides, strict=True))]

    # Groups and sub-meshes ------------------------------------------------------------------

    def _axis_indices(self, axes: str | int | Sequence[str | int]) -> tuple[int, ...]:
        items: Sequence[str | int] = [axes] if isinstance(axes, str | int) else axes
        indices = tuple(self.axis_index(a) for a in items)
        if len(set(indices)) != len(indices):
            raise MeshError(f"mesh axes {list(items)} name an axis twice")
        return indices

    def groups(self, axes: str | int | Sequence[str | int]) -> tuple[tuple[int, ...], ...]:
        """All rank groups along ``axes``.

        Each group holds the ranks that differ only in the coordinates of ``axes``, ordered
        row-major over ``axes`` in the order given. Groups are ordered row-major over the
        remaining axes. Together they partition the mesh.
        """
        chosen = self._axis_indices(axes)
        rest = tuple(i for i in range(self.ndim) if i not in chosen)
        out = []
        for rest_coord in _iter_coords([self.shape[i] for i in rest]):
            coord = [0] * self.ndim
            for i, c in zip(rest, rest_coord, strict=True):
                coord[i] = c
            group = []
            for chosen_coord in _iter_coords([self.shape[i] for i in chosen]):
                for i, c in zip(chosen, chosen_coord, strict=True):
                    coord[i] = c
                group.append(self.rank_at(coord))
            out.append(tuple(group))
        return tuple(out)

    def group_of(self, rank: int, axes: str | int | Sequence[str | int]) -> tuple[int, ...]:
        """The group along ``axes`` that contains ``rank`` (ordered as in :meth:`groups`)."""
        chosen = self._axis_indices(axes)
        coord = list(self.coordinate(rank))
        group = []
        for chosen_coord in _iter_coords([self.shape[i] for i in chosen]):
            for i, c in zip(chosen, chosen_coord, strict=True):
                coord[i] = c
            group.append(self.rank_at(coord))
        return tuple(group)

    def submesh(self, axes: str | int | Sequence[str | int], rank: int | None = None) -> Mesh:
        """The sub-mesh over ``axes`` (in the order given) that contains ``rank``.

        ``rank`` may be omitted when every other axis has size 1, i.e. when only one
        sub-mesh exists.
        """
        chosen = self._axis_indices(axes)
        if rank is None:
            if any(self.shape[i] > 1 for i in range(self.ndim) if i not in chosen):
                raise MeshError(
                    f"{self!r} has several sub-meshes over {[self.axis_names[i] for i in chosen]};"
                    " pass rank= to say which"
                )
            rank = self.ranks[0]
        return Mesh(
            [self.shape[i] for i in chosen],
            [self.axis_names[i] for i in chosen],
            self.group_of(rank, chosen),
        )

    def submeshes(self, axes: str | int | Sequence[str | int]) -> tuple[Mesh, ...]:
        """Every sub-mesh over ``axes``, in the order of :meth:`groups`."""
        chosen = self._axis_indices(axes)
        shape = [self.shape[i] for i in chosen]
        names = [self.axis_names[i] for i in chosen]
        return tuple(Mesh(shape, names, g) for g in self.groups(chosen))

    def flatten(self, axes: Sequence[str | int] | None = None, name: str | None = None) -> Mesh:
        """Merge ``axes`` (default: all) into one axis, row-major in the order given.

        The merged axis takes the place of the first axis named; the other axes keep their
        order. The rank grid is permuted accordingly, so every rank keeps its identity and
        groups along the new axis are the groups along ``axes`` of this mesh.
        """
        chosen = self._axis_indices(list(range(self.ndim)) if axes is None else list(axes))
        if not chosen:
            raise MeshError("flatten needs at least one axis")
        merged = name if name is not None else "_".join(self.axis_names[i] for i in chosen)
        first = min(chosen)
        order: list[int] = []
        for i in range(self.ndim):
            if i == first:
                order.extend(chosen)
            elif i not in chosen:
                order.append(i)
        names: list[str] = []
        shape: list[int] = []
        for i in range(self.ndim):
            if i == first:
                names.append(merged)
                shape.append(math.prod(self.shape[j] for j in chosen))
            elif i not in chosen:
                names.append(self.axis_names[i])
                shape.append(self.shape[i])
        ranks = []
        for permuted in _iter_coords([self.shape[i] for i in order]):
            coord = [0] * self.ndim
            for i, c in zip(order, permuted, strict=True):
                coord[i] = c
            ranks.append(self.rank_at(coord))
        return Mesh(shape, names, ranks)
