from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hp_layout import chunk_bounds, chunk_length, chunk_sizes


@given(st.integers(0, 60), st.integers(1, 12))
def test_parts_tile_the_range_in_order(length: int, parts: int) -> None:
    bounds = [chunk_bounds(length, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == length
    for (a0, a1), (b0, b1) in itertools.pairwise(bounds):
        assert a0 <= a1 == b0 <= b1
    biggest = -(-length // parts)
    assert all(b - a <= biggest for a, b in bounds)
    # Every part before the first short one is full (torch.chunk fills from the front).
    sizes = chunk_sizes(length, parts)
    first_short = next((i for i, s in enumerate(sizes) if s < biggest), parts)
    assert all(s == biggest for s in sizes[:first_short])
    assert all(s == 0 for s in sizes[first_short + 1 :])


@pytest.mark.parametrize(
    ("length", "parts", "expected"),
    [
        # Values torch.chunk gives (padded with empty chunks to `parts`, as DTensor does).
        (5, 4, (2, 2, 1, 0)),
        (6, 4, (2, 2, 2, 0)),
        (3, 4, (1, 1, 1, 0)),
        (8, 3, (3, 3, 2)),
        (0, 3, (0, 0, 0)),
        (7, 1, (7,)),
    ],
)
def test_matches_torch_chunk(length: int, parts: int, expected: tuple[int, ...]) -> None:
    assert chunk_sizes(length, parts) == expected
    assert tuple(chunk_length(length, parts, i) for i in range(parts)) == expected


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="parts must be positive"):
        chunk_bounds(4, 0, 0)
    with pytest.raises(ValueError, match=r"index must be in \[0, 2\)"):
        chunk_bounds(4, 2, 2)
    with pytest.raises(ValueError, match="length must be non-negative"):
        chunk_bounds(-1, 2, 0)
