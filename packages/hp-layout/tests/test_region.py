from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hp_layout.region import Region, box_numel, flat_range_boxes


@st.composite
def box_and_range(draw: st.DrawFn) -> tuple[tuple[tuple[int, int], ...], int, int]:
    ndim = draw(st.integers(0, 4))
    box = []
    for _ in range(ndim):
        start = draw(st.integers(0, 3))
        box.append((start, start + draw(st.integers(0, 5))))
    total = box_numel(tuple(box))
    a = draw(st.integers(0, total))
    b = draw(st.integers(a, total))
    return tuple(box), a, b


@given(box_and_range())
def test_flat_range_boxes_cover_exactly_the_range(
    case: tuple[tuple[tuple[int, int], ...], int, int],
) -> None:
    box, start, stop = case
    shape = tuple(b for _, b in box)
    index = np.arange(int(np.prod(shape))).reshape(shape) if shape else np.array(0)
    inside = index[tuple(slice(a, b) for a, b in box)].reshape(-1)[start:stop]
    boxes = flat_range_boxes(box, start, stop)
    covered = (
        np.concatenate([index[tuple(slice(a, b) for a, b in bx)].reshape(-1) for bx in boxes])
        if boxes
        else np.array([], dtype=int)
    )
    assert covered.tolist() == inside.tolist()  # disjoint, row-major, exact
    assert len(boxes) <= max(1, 2 * len(box) - 1)
    assert all(box_numel(bx) > 0 for bx in boxes)


def test_region_intersects() -> None:
    region = Region(((0, 2), (0, 3)), flat=(2, 4))
    assert region.shape == (2,)
    assert region.boxes() == (((0, 1), (2, 3)), ((1, 2), (0, 1)))
    assert region.intersects(((1, 2), (0, 1)))
    assert not region.intersects(((1, 2), (1, 3)))
