"""Stage splitting: the balanced split against brute force over every contiguous split, and
measured costs (single process)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from hp_mpmd import balanced_boundaries, build_stages, layers_of, measured_costs


def _stage_costs(costs: list[float], bounds: tuple[int, ...]) -> list[float]:
    return [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]


def _optimal_splits(costs: list[float], stages: int) -> tuple[float, list[tuple[int, ...]]]:
    """Brute force: the least largest stage cost, and every split that attains it."""
    n = len(costs)
    best = float("inf")
    found: list[tuple[int, ...]] = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        worst = max(_stage_costs(costs, bounds))
        if worst < best:
            best, found = worst, [bounds]
        elif worst == best:
            found.append(bounds)
    return best, found


def test_balanced_split_is_the_brute_force_optimum() -> None:
    rng = random.Random(0)
    cases = [([4.0, 1.0, 1.0, 1.0, 1.0, 4.0], 3), ([1.0] * 7, 4), ([0.0, 0.0, 5.0], 2)]
    for _ in range(400):
        n = rng.randint(1, 8)
        cases.append(([float(rng.choice([0, 1, 2, 3, 5, 8])) for _ in range(n)], rng.randint(1, n)))
    for costs, stages in cases:
        got = balanced_boundaries(costs, stages)
        best, optimal = _optimal_splits(costs, stages)
        assert len(got) == stages + 1
        assert max(_stage_costs(costs, got)) == best, (costs, stages, got)
        assert got in optimal
        if stages > 1:
            # Ties: the earliest last cut any optimal split has; the layers before it are
            # split the same way.
            assert got[-2] == min(b[-2] for b in optimal), (costs, stages, got)
            assert got[:-1] == balanced_boundaries(costs[: got[-2]], stages - 1)


def test_uneven_costs_give_uneven_layer_counts() -> None:
    assert balanced_boundaries([1.0] * 7, 4) == (0, 1, 3, 5, 7)
    assert balanced_boundaries([8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == (0, 1, 9)
    assert balanced_boundaries([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 8.0], 2) == (0, 8, 9)


def test_measured_costs_time_each_layer_on_its_own_input() -> None:
    # An embedding (integer input: no input gradient) then linears of changing width: a
    # layer handed anything but its predecessor's output would fail on the shape.
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    layers = layers_of(model)
    example = torch.randint(0, 10, (5, 2))
    costs = measured_costs(layers, example, repeats=3)
    assert len(costs) == 4
    assert all(c > 0 for c in costs)
    # Timing leaves no gradient behind, and the example is untouched.
    assert all(p.grad is None for p in model.parameters())
    assert example.dtype == torch.int64
    bounds = balanced_boundaries(costs, 2)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert [len(s) for s in build_stages(layers, bounds)] == sizes


def test_measured_costs_reject_a_layer_that_cannot_take_the_previous_output() -> None:
    layers = layers_of(nn.Sequential(nn.Linear(4, 8), nn.Linear(4, 2)))
    with pytest.raises(RuntimeError):
        measured_costs(layers, torch.randn(3, 4), repeats=1)
