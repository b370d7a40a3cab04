"""Index regions of a tensor: boxes, and contiguous row-major ranges inside a box.

A shard of a tensor is either a box (one ``[start, stop)`` interval per dimension) or, after a
:class:`hp_layout.RaggedShard`, a contiguous range of the row-major flattening of a box.
Either can be written as a short list of disjoint boxes (:meth:`Region.boxes`), which is what
intersections and the ranks-holding queries use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["Box", "Region", "box_intersection", "box_numel", "flat_range_boxes"]

Box: TypeAlias = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` interval per tensor dimension."""


def box_numel(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(max(0, b - a) for a, b in box)


def box_intersection(left: Box, right: Box) -> Box:
    """The box common to ``left`` and ``right`` (possibly empty; then every interval is valid)."""
    out = []
    for (a0, a1), (b0, b1) in zip(left, right, strict=True):
        lo = max(a0, b0)
        out.append((lo, max(lo, min(a1, b1))))
    return tuple(out)


def flat_range_boxes(box: Box, start: int, stop: int) -> tuple[Box, ...]:
    """Disjoint boxes covering elements ``[start, stop)`` of the row-major flattening of ``box``.

    Postconditions: the boxes are non-empty, disjoint, in row-major order, and their numels
    sum to ``stop - start``; there are at most ``2 * len(box) - 1`` of them.
    """
    total = box_numel(box)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a box of {total} elements")
    if start == stop:
        return ()
    if not box:
        return ((),)
    (lo, _), rest = box[0], box[1:]
    inner = box_numel(rest)
    row_a, col_a = divmod(start, inner)
    row_b, col_b = divmod(stop, inner)
    if row_a == row_b:
        return tuple(
            ((lo + row_a, lo + row_a + 1), *b) for b in flat_range_boxes(rest, col_a, col_b)
        )
    out: list[Box] = []
    if col_a:
        out.extend(((lo + row_a, lo + row_a + 1), *b) for b in flat_range_boxes(rest, col_a, inner))
        row_a += 1
    if row_b > row_a:
        out.append(((lo + row_a, lo + row_b), *rest))
    if col_b:
        out.extend(((lo + row_b, lo + row_b + 1), *b) for b in flat_range_boxes(rest, 0, col_b))
    return tuple(out)


@dataclass(frozen=True)
class Region:
    """The elements of a global tensor that one rank holds.

    Attributes:
        box: one ``(start, stop)`` interval per dimension of the global tensor.
        flat: ``None`` when the rank holds the whole box; otherwise the ``(start, stop)``
            range of the box's row-major flattening that it holds (the local data is then
            1-D).
    """

    box: Box
    flat: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the local data: the box's extents, or ``(stop - start,)`` when flat."""
        if self.flat is not None:
            return (self.flat[1] - self.flat[0],)
        return tuple(b - a for a, b in self.box)

    @property
    def offset(self) -> tuple[int, ...]:
        """Global index of the box's first element."""
        return tuple(a for a, _ in self.box)

    @property
    def numel(self) -> int:
        """Number of elements held."""
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return box_numel(self.box)

    def boxes(self) -> tuple[Box, ...]:
        """Disjoint, non-empty boxes (global indices) that together are exactly this region."""
        if self.flat is None:
            return (self.box,) if box_numel(self.box) else ()
        return flat_range_boxes(self.box, *self.flat)

    def intersects(self, box: Sequence[tuple[int, int]]) -> bool:
        """True when this region and ``box`` share at least one element."""
        target = tuple(box)
        return any(box_numel(box_intersection(b, target)) for b in self.boxes())
