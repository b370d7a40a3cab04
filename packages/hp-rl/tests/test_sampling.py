"""``hp_rl.sampling``: greedy, top-k / top-p support, draw frequencies, the log-probability the
trainer computes, seeding, overflowing logits and parameter validation.

Oracles are written here: the filtered support by sorting Python floats, the probabilities
and log-probabilities in float64 with ``math``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hp_rl.sampling import SamplingParams, filter_logits, sample_next


def _support(row: list[float], top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, by brute force: sort, cut at k, renormalize, take
    the most likely tokens until their mass reaches top_p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if top_k:
        order = order[:top_k]
    peak = max(row[i] for i in order)
    weights = [math.exp(row[i] - peak) for i in order]
    total = sum(weights)
    kept: list[int] = []
    mass = 0.0
    for i, w in zip(order, weights, strict=True):
        kept.append(i)
        mass += w / total
        if mass >= top_p:
            break
    return set(kept)


def _filtered_probs(row: list[float], top_k: int, top_p: float) -> dict[int, float]:
    keep = _support(row, top_k, top_p)
    peak = max(row[i] for i in keep)
    weights = {i: math.exp(row[i] - peak) for i in keep}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


def _log_softmax(row: list[float], temperature: float) -> list[float]:
    scaled = [x / temperature for x in row]
    peak = max(scaled)
    log_total = peak + math.log(sum(math.exp(x - peak) for x in scaled))
    return [x - log_total for x in scaled]


def test_greedy_is_argmax_and_its_logprob_is_at_temperature_one() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 40, generator=g) * 3
    state = g.get_state()
    tokens, logprobs = sample_next(logits, SamplingParams(4, temperature=0.0), g)
    assert torch.equal(g.get_state(), state), "greedy must not draw from the generator"
    for b, row in enumerate(logits.tolist()):
        best = max(range(len(row)), key=lambda i: row[i])
        assert int(tokens[b]) == best
        assert logprobs[b].item() == pytest.approx(_log_softmax(row, 1.0)[best], abs=1e-5)
    assert tokens.dtype == torch.int64
    assert logprobs.dtype == torch.float32


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.6), (7, 0.8), (1, 0.3), (0, 1e-6)])
def test_filtered_support_matches_a_brute_force_sort(top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(1)
    scaled = torch.randn(32, 24, generator=g) * 2
    kept = filter_logits(scaled, top_k, top_p)
    for b, row in enumerate(scaled.tolist()):
        got = set(torch.isfinite(kept[b]).nonzero().flatten().tolist())
        assert got == _support(row, top_k, top_p), f"row {b}"
        # The kept logits are unchanged (filtering removes, never rescales).
        assert torch.equal(kept[b][list(got)], scaled[b][list(got)])


def test_top_p_keeps_the_token_that_reaches_the_mass() -> None:
    # probabilities 0.5, 0.3, 0.2: top_p 0.75 needs the first two (0.5 < 0.75 <= 0.8).
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    kept = filter_logits(logits, 0, 0.75)
    assert torch.isfinite(kept).tolist() == [[True, True, False]]
    # top_k 2 first: renormalized 0.625, 0.375; top_p 0.6 then needs only the first.
    kept = filter_logits(logits, 2, 0.6)
    assert torch.isfinite(kept).tolist() == [[True, False, False]]


def test_draw_frequencies_follow_the_filtered_softmax() -> None:
    row = [2.0, 1.5, 1.0, 0.7, 0.2, -1.0, -3.0]
    params = SamplingParams(1, temperature=0.8, top_k=5, top_p=0.9)
    draws = 40_000
    logits = torch.tensor(row).expand(draws, -1)
    tokens, _ = sample_next(logits, params, torch.Generator().manual_seed(7))
    expected = _filtered_probs([x / 0.8 for x in row], 5, 0.9)
    counts = torch.bincount(tokens, minlength=len(row)).tolist()
    assert all(counts[i] == 0 for i in range(len(row)) if i not in expected)
    chi2 = sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in expected.items())
    # 99.99th percentile of chi-square with <= 4 degrees of freedom is ~23.5.
    assert len(expected) >= 3
    assert chi2 < 23.5, (counts, expected)


def test_logprob_is_the_unfiltered_softmax_at_the_temperature() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 30, generator=g) * 2
    params = SamplingParams(1, temperature=0.7, top_k=3, top_p=0.8)
    tokens, logprobs = sample_next(logits, params, g)
    for b, row in enumerate(logits.tolist()):
        token = int(tokens[b])
        assert token in _support([x / 0.7 for x in row], 3, 0.8)
        want = _log_softmax(row, 0.7)[token]
        assert logprobs[b].item() == pytest.approx(want, abs=1e-5), f"row {b}"


def test_same_seed_same_tokens() -> None:
    logits = torch.randn(50, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(1, temperature=1.3, top_p=0.95)
    first = sample_next(logits, params, torch.Generator().manual_seed(11))
    again = sample_next(logits, params, torch.Generator().manual_seed(11))
    other = sample_next(logits, params, torch.Generator().manual_seed(12))
    assert torch.equal(first[0], again[0])
    assert torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_huge_and_minus_inf_logits_give_finite_logprobs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    scale = 6e4 if dtype == torch.float16 else 1e4
    logits = (torch.randn(200, 20, generator=g) * scale).clamp(-6e4, 6e4)
    banned = torch.rand(200, 20, generator=g) < 0.3
    banned[:, 0] = False
    logits = logits.masked_fill(banned, -math.inf).to(dtype)
    for params in (
        SamplingParams(1, temperature=0.5),
        SamplingParams(1, temperature=1.0, top_k=4, top_p=0.9),
        SamplingParams(1, temperature=0.0),
    ):
        tokens, logprobs = sample_next(logits, params, g)
        assert not banned.gather(1, tokens[:, None]).any(), "drew a -inf token"
        assert torch.isfinite(logprobs).all(), params
        assert (logprobs <= 0).all()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_new_tokens": 4, "temperature": math.inf}, "temperature"),
        ({"max_new_tokens": 4, "temperature": math.nan}, "temperature"),
        ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
        ({"max_new_tokens": 4, "top_k": 1.5}, "top_k"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.01}, "top_p"),
        ({"max_new_tokens": 4, "stop_tokens": [1]}, "stop_tokens"),
        ({"max_new_tokens": 4, "stop_tokens": (-1,)}, "stop_tokens"),
    ],
)
def test_bad_params_are_rejected_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_logits_are_rejected() -> None:
    g = torch.Generator()
    params = SamplingParams(1)
    with pytest.raises(ValueError, match="row 1"):
        sample_next(torch.tensor([[0.0, 1.0], [math.nan, 0.0]]), params, g)
    with pytest.raises(ValueError, match="row 0"):
        sample_next(torch.tensor([[-math.inf, -math.inf]]), params, g)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(torch.tensor([[3e38, 0.0]]), SamplingParams(1, temperature=0.1), g)
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        sample_next(torch.zeros(3), params, g)
    with pytest.raises(TypeError, match="floating"):
        sample_next(torch.zeros(2, 3, dtype=torch.int64), params, g)
