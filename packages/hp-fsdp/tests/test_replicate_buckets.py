"""The replicate-axis bucket plan: the cap minimizes the cost it states, the cuts keep their
postconditions (checked by brute force over random sizes), bad input is refused."""

from __future__ import annotations

import math
import random

import pytest

from hp_fsdp.replicate_buckets import bucket_cap_bytes, plan_replicate_buckets


def test_cuts_close_a_bucket_at_the_first_group_that_fills_it() -> None:
    def cuts(sizes: list[int], cap: int) -> list[list[int]]:
        return [list(b) for b in plan_replicate_buckets(sizes, cap).buckets]

    assert cuts([40, 40, 120, 20, 20, 20], 80) == [[0, 1], [2], [3, 4, 5]]
    assert cuts([40, 40, 120, 20, 20, 20], 81) == [[0, 1, 2], [3, 4, 5]]
    assert cuts([40, 40, 120, 20, 20, 20], 10_000) == [[0, 1, 2, 3, 4, 5]]
    assert cuts([100, 4, 4], 100) == [[0], [1, 2]]
    assert cuts([10, 0, 10], 1) == [[0], [1, 2]]  # an empty chunk fills nothing
    assert cuts([], 5) == []
    assert plan_replicate_buckets([7], 3).cap_bytes == 3


def test_cuts_keep_their_postconditions() -> None:
    rng = random.Random(0)
    for _ in range(500):
        count = rng.randrange(12)
        sizes = [rng.choice([0, 1, 4, 64, 1000, rng.randrange(5000)]) for _ in range(count)]
        cap = rng.choice([1, 3, 64, 500, 4096, 10**6])
        buckets = plan_replicate_buckets(sizes, cap).buckets
        assert [i for b in buckets for i in b] == list(range(len(sizes)))
        assert all(b for b in buckets)
        assert all(b == tuple(range(b[0], b[-1] + 1)) for b in buckets)
        for b in buckets[:-1]:
            assert sum(sizes[i] for i in b) >= cap, (sizes, cap, buckets)
        for b in buckets:
            assert sum(sizes[i] for i in b[:-1]) < cap, (sizes, cap, buckets)


def _cost(n: int, gradient: float, replicas: int, latency: float, bandwidth: float) -> float:
    """Latency paid by the link for n all-reduces plus the last bucket's exposed transfer."""
    r = replicas
    return n * 2 * (r - 1) * latency + 2 * (r - 1) / r * (gradient / n) / bandwidth


def test_the_cap_gives_the_bucket_count_of_least_cost() -> None:
    """For a gradient of one-byte groups the plan's bucket count is the brute-force argmin of
    the stated cost, to within the rounding of the cap."""
    cases = [
        (20_000, 2, 2e-5, 12.5e3),  # r a b = 0.5 bytes: 200 buckets
        (50_000, 4, 1e-3, 1e3),
        (3_000, 8, 1e-6, 1e5),
        (500, 2, 1e-3, 1e3),  # r a b = 2 bytes: about 16 buckets
        (100, 2, 1.0, 1e3),  # r a b = 2000 bytes, more than the gradient: one bucket
    ]
    for gradient, r, a, b in cases:
        cap = bucket_cap_bytes(gradient, r, a, b)
        assert cap == math.ceil(math.sqrt(gradient * r * a * b))
        planned = len(plan_replicate_buckets([1] * gradient, cap).buckets)
        best = min(range(1, gradient + 1), key=lambda n: _cost(n, gradient, r, a, b))
        assert abs(planned - best) <= 1, (gradient, r, a, b, planned, best)
        if gradient <= r * a * b:
            assert planned == 1


def test_the_cap_grows_with_each_argument() -> None:
    base = bucket_cap_bytes(10**9, 2, 2e-5, 12.5e9)
    assert base == math.ceil(math.sqrt(10**9 * 2 * 2e-5 * 12.5e9))  # 22.4 MB
    assert bucket_cap_bytes(4 * 10**9, 2, 2e-5, 12.5e9) > base
    assert bucket_cap_bytes(10**9, 8, 2e-5, 12.5e9) > base
    assert bucket_cap_bytes(10**9, 2, 1e-4, 12.5e9) > base
    assert bucket_cap_bytes(10**9, 2, 2e-5, 50e9) > base
    assert bucket_cap_bytes(0, 2, 2e-5, 12.5e9) == 1
    assert bucket_cap_bytes(10**9, 2, 0.0, 12.5e9) == 1


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="gradient_bytes must be non-negative"):
        bucket_cap_bytes(-1, 2, 1e-5, 1e9)
    with pytest.raises(ValueError, match="replicate_size must be at least 1"):
        bucket_cap_bytes(10, 0, 1e-5, 1e9)
    with pytest.raises(ValueError, match="latency >= 0 and bandwidth > 0"):
        bucket_cap_bytes(10, 2, -1e-5, 1e9)
    with pytest.raises(ValueError, match="latency >= 0 and bandwidth > 0"):
        bucket_cap_bytes(10, 2, 1e-5, 0.0)
    with pytest.raises(ValueError, match="cap_bytes must be at least 1"):
        plan_replicate_buckets([1, 2], 0)
    with pytest.raises(ValueError, match="chunk sizes must be non-negative"):
        plan_replicate_buckets([1, -2], 4)
