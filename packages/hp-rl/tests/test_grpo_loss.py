"""GRPO's advantages and loss against formulas written here as plain loops over tokens."""

from __future__ import annotations

import math
import statistics
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from hp_rl.grpo import GRPOLossConfig, group_advantages, grpo_loss, k3_kl, loss_units
from hp_testing import run_on_ranks

Aggregation = Literal["sequence_mean", "token_mean"]


# --- the oracle: one token at a time ---------------------------------------------------------


def _loop_loss(
    lp: Tensor,
    old: list[list[float]],
    adv: list[float],
    mask: list[list[bool]],
    *,
    low: float,
    high: float,
    kl_coef: float,
    ref: list[list[float]] | None,
    aggregation: Aggregation,
    divisor: float | None = None,
) -> Tensor:
    """The GRPO loss token by token, with torch scalars (so autograd gives the gradient) and
    Python's own comparisons for clip and min. ``lp`` is a leaf [B, T] tensor."""
    total = torch.zeros((), dtype=torch.float64)
    units = 0
    for b in range(len(mask)):
        n = sum(mask[b])
        if n == 0:
            continue
        seq = torch.zeros((), dtype=torch.float64)
        for t in range(len(mask[b])):
            if not mask[b][t]:
                continue
            x = lp[b, t].double()
            ratio = torch.exp(x - old[b][t])
            r = ratio.item()
            clipped_ratio = low if r < low else high if r > high else None
            unclipped = ratio * adv[b]
            if clipped_ratio is None:
                surrogate = unclipped
            else:
                clipped_value = clipped_ratio * adv[b]  # a constant: no gradient
                if unclipped.item() <= clipped_value:
                    surrogate = unclipped
                else:
                    surrogate = torch.tensor(clipped_value, dtype=torch.float64)
            term = -surrogate
            if ref is not None:
                d = ref[b][t] - x
                term = term + kl_coef * (torch.exp(d) - d - 1)
            seq = seq + term
        if aggregation == "sequence_mean":
            total = total + seq / n
            units += 1
        else:
            total = total + seq
            units += n
    return total / (divisor if divisor is not None else max(units, 1))


def _batch(seed: int, b: int = 6, t: int = 7) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Log-probabilities with ratios spread over and beyond the clip band, one sequence with no
    response token, and garbage (NaN, inf) at padded positions."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.1
    lp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[2] = 0
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    # Response tokens start after a prompt of 1 token in some rows: masks need not be prefixes.
    mask[0, 0] = False
    lp = torch.where(mask, lp, torch.full_like(lp, math.nan))
    old = torch.where(mask, old, torch.full_like(old, math.inf))
    ref = torch.where(mask, ref, torch.full_like(ref, -math.inf))
    return lp, old, adv, mask, ref


def _lists(x: Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in x.tolist()]


# --- the loss -------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
def test_loss_and_gradient_match_the_token_loop(
    aggregation: Aggregation, kl_coef: float, clip_eps_high: float | None
) -> None:
    """Loss and gradient equal the loop's, padded garbage never reaches either, and the padded
    positions' gradient is exactly 0."""
    lp, old, adv, mask, ref = _batch(seed=1)
    config = GRPOLossConfig(
        clip_eps=0.2, clip_eps_high=clip_eps_high, kl_coef=kl_coef, loss_aggregation=aggregation
    )
    high = 1 + (0.2 if clip_eps_high is None else clip_eps_high)
    x = lp.clone().requires_grad_(True)
    loss, stats = grpo_loss(x, old, adv, mask, config, ref_logprobs=ref)
    loss.backward()
    assert x.grad is not None
    got_grad = x.grad.clone()

    y = lp.clone().requires_grad_(True)
    want = _loop_loss(
        y, _lists(old), adv.tolist(), mask.tolist(), low=0.8, high=high, kl_coef=kl_coef,
        ref=_lists(ref), aggregation=aggregation,
    )  # fmt: skip
    want.backward()
    assert y.grad is not None
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_grad, y.grad, rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(got_grad).all())
    assert bool((got_grad[~mask] == 0).all())
    assert stats.loss.item() == pytest.approx(loss.item())
    assert (stats.policy_loss + stats.kl_loss).item() == pytest.approx(loss.item(), abs=1e-6)
    assert stats.tokens.item() == int(mask.sum())
    assert stats.sequences.item() == len(mask) - 1


def test_statistics_match_the_loop() -> None:
    """kl is the token mean of k3, ratio_mean/max/min over response tokens only."""
    lp, old, adv, mask, ref = _batch(seed=2)
    _, stats = grpo_loss(lp, old, adv, mask, GRPOLossConfig(), ref_logprobs=ref)
    ratios, k3s = [], []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                ratios.append(math.exp(lp[b, t].item() - old[b, t].item()))
                d = ref[b, t].item() - lp[b, t].item()
                k3s.append(math.exp(d) - d - 1)
    assert stats.kl.item() == pytest.approx(sum(k3s) / len(k3s), rel=1e-5)
    assert stats.ratio_mean.item() == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert stats.ratio_max.item() == pytest.approx(max(ratios), rel=1e-5)
    assert stats.ratio_min.item() == pytest.approx(min(ratios), rel=1e-5)
    assert stats.kl_loss.item() == 0.0


def test_clip_is_active_exactly_outside_the_band_on_the_losing_side() -> None:
    """One token per case. The clip holds (zero gradient) only for a positive advantage with
    the ratio above 1 + eps_high and for a negative advantage with the ratio below 1 - eps;
    elsewhere the gradient is the unclipped one, -A * ratio / tokens."""
    eps, eps_high = 0.2, 0.3
    #            (advantage, ratio, clip active)
    cases = [
        (+1.0, 1.5, True),  # above the band, A > 0: more would be rewarded, clipped
        (+1.0, 0.5, False),  # below the band, A > 0: the min keeps the unclipped term
        (-1.0, 0.5, True),  # below the band, A < 0: clipped
        (-1.0, 1.5, False),  # above the band, A < 0: the min keeps the unclipped term
        (+2.0, 1.25, False),  # inside the band (above 1 + eps, below 1 + eps_high)
        (-2.0, 0.9, False),  # inside the band
        (0.0, 1.5, False),  # no advantage: nothing to clip
    ]
    n = len(cases)
    ratio = torch.tensor([[c[1]] for c in cases], dtype=torch.float64)
    old = torch.full((n, 1), -1.0, dtype=torch.float64)
    lp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    mask = torch.ones(n, 1, dtype=torch.bool)
    config = GRPOLossConfig(clip_eps=eps, clip_eps_high=eps_high, loss_aggregation="token_mean")
    loss, stats = grpo_loss(lp, old, adv, mask, config)
    loss.backward()
    assert lp.grad is not None
    for i, (a, r, active) in enumerate(cases):
        # d/dlp of -(A * exp(lp - old)) / n is -A * ratio / n.
        want = 0.0 if active else -a * r / n
        assert lp.grad[i, 0].item() == pytest.approx(want, abs=1e-7), (a, r, active)
    surrogates = [min(a * r, min(max(r, 1 - eps), 1 + eps_high) * a) for a, r, _ in cases]
    assert loss.item() == pytest.approx(-sum(surrogates) / n, rel=1e-6)
    active_count = sum(c[2] for c in cases)
    assert stats.clip_fraction.item() == pytest.approx(active_count / n)


def test_k3_is_non_negative_and_zero_at_equality() -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    b = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    k = k3_kl(a, b)
    assert bool((k >= 0).all())
    assert bool((k3_kl(a, a) == 0).all())
    for x, y, kv in zip(a.tolist()[:20], b.tolist()[:20], k.tolist()[:20], strict=True):
        assert kv == pytest.approx(math.exp(x - y) - (x - y) - 1, rel=1e-12)


def test_kl_penalty_pulls_toward_the_reference() -> None:
    """With no advantage the loss is +kl_coef * mean k3 (> 0), and a gradient step moves the
    log-probabilities toward the reference's."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    config = GRPOLossConfig(kl_coef=0.5)
    loss, stats = grpo_loss(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), mask, config, ref)
    k3 = [
        math.exp(r - x) - (r - x) - 1
        for r, x in zip([-1.5, -1.0, -0.5], [-1.0, -2.0, -0.5], strict=True)
    ]
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 3, rel=1e-6)
    assert loss.item() > 0
    assert stats.kl.item() == pytest.approx(sum(k3) / 3, rel=1e-6)
    loss.backward()
    assert lp.grad is not None
    step = -lp.grad[0]
    assert step[0].item() < 0 < step[1].item()  # toward -1.5 and toward -1.0
    assert step[2].item() == 0.0


def test_sequence_mean_weighs_sequences_equally_token_mean_weighs_tokens() -> None:
    """A 1-token sequence and a 3-token one, per-token losses -A * 1 (ratio 1): the two
    aggregations give the formulas' different numbers."""
    lp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    seq, _ = grpo_loss(lp, lp, adv, mask, GRPOLossConfig())
    tok, _ = grpo_loss(lp, lp, adv, mask, GRPOLossConfig(loss_aggregation="token_mean"))
    assert seq.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert tok.item() == pytest.approx((-1.0 + 3 * 2.0) / 4)


def test_no_response_token_gives_zero_loss_and_gradient() -> None:
    lp = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, stats = grpo_loss(lp, lp.detach(), torch.ones(2, dtype=torch.float64), mask,
                            GRPOLossConfig())  # fmt: skip
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad is not None
    assert bool((lp.grad == 0).all())
    assert stats.tokens.item() == 0
    assert stats.ratio_max.item() == 1.0
    assert stats.ratio_mean.item() == 1.0


# --- data parallelism -----------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_data_parallel_halves_sum_to_the_whole_batch(aggregation: Aggregation) -> None:
    """Two unequal parts of a batch with the global count as normalizer: their losses and
    gradients sum to the whole batch's; with the count divided by 2 (an averaging trainer)
    their mean does."""
    lp, old, adv, mask, ref = _batch(seed=4, b=7)
    config = GRPOLossConfig(kl_coef=0.1, loss_aggregation=aggregation)
    whole = lp.clone().requires_grad_(True)
    full, _ = grpo_loss(whole, old, adv, mask, config, ref)
    full.backward()
    assert whole.grad is not None
    cuts = [slice(0, 3), slice(3, 7)]  # row 2 (no response token) lies in the first part
    units = sum(loss_units(mask[c], config) for c in cuts)
    assert units == loss_units(mask, config)
    for divide, combine in ((units, 1.0), (units / 2, 0.5)):
        parts = lp.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for c in cuts:
            part, _ = grpo_loss(parts[c], old[c], adv[c], mask[c], config, ref[c],
                                normalizer=divide)  # fmt: skip
            (part * combine).backward()
            total = total + part.detach() * combine
        assert parts.grad is not None
        assert total.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-5, atol=1e-7)


def _rank_gradient(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, ref: Tensor) -> list[float]:
    """On each of 2 ranks: half the batch, the global normalizer from an all-reduce of the
    local counts divided by the world size, and the gradient averaged over ranks as a
    data-parallel trainer does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GRPOLossConfig(kl_coef=0.1)
    rows = slice(0, 3) if rank == 0 else slice(3, lp.shape[0])
    count = torch.tensor(float(loss_units(mask[rows], config)), dtype=torch.float64)
    dist.all_reduce(count)
    weight = torch.zeros(lp.shape[1], dtype=torch.float64, requires_grad=True)
    # A stand-in for the model: the log-probabilities depend on a shared parameter.
    local_lp = lp[rows] + weight
    loss, _ = grpo_loss(local_lp, old[rows], adv[rows], mask[rows], config, ref[rows],
                        normalizer=count.item() / world)  # fmt: skip
    loss.backward()
    assert weight.grad is not None
    grad = weight.grad.clone()
    dist.all_reduce(grad)
    grad /= world
    return [float(v) for v in grad.tolist()]


def test_data_parallel_ranks_average_to_the_global_gradient() -> None:
    """Two gloo ranks that average their gradients, as hp-fsdp does, reproduce the gradient of
    the whole batch on one process."""
    lp, old, adv, mask, ref = _batch(seed=5, b=7)
    lp = torch.where(mask, lp, torch.zeros_like(lp))
    weight = torch.zeros(lp.shape[1], dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(lp + weight, old, adv, mask, GRPOLossConfig(kl_coef=0.1), ref)
    loss.backward()
    assert weight.grad is not None
    got = run_on_ranks(2, _rank_gradient, lp, old, adv, mask, ref)
    for grad in got:
        assert grad == pytest.approx(weight.grad.tolist(), rel=1e-6, abs=1e-9)


# --- group advantages -----------------------------------------------------------------------


def _loop_advantages(rewards: list[float], g: int, eps: float, scale: bool) -> list[float]:
    out: list[float] = []
    for start in range(0, len(rewards), g):
        group = rewards[start : start + g]
        mean = statistics.fmean(group)
        spread = statistics.stdev(group)  # the sample (unbiased) deviation, divisor g - 1
        for r in group:
            if len(set(group)) == 1:
                out.append(0.0)
            else:
                out.append((r - mean) / (spread + eps) if scale else r - mean)
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_each_groups_statistics(scale: bool) -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.25, 3.0, -1.0, 0.5, 0.7, 0.7, 0.7, 0.7]
    got = group_advantages(torch.tensor(rewards), 4, eps=1e-4, scale=scale)
    assert got.dtype == torch.float32
    assert got.shape == (16,)
    want = _loop_advantages(rewards, 4, 1e-4, scale)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_group_of_equal_rewards_has_exactly_zero_advantage() -> None:
    """Even when the group's mean is not exactly its value in floating point (0.1 * 3 / 3)."""
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 7.3, 7.3, 7.3], dtype=torch.float64)
    got = group_advantages(rewards, 3)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[6:].tolist() == [0.0, 0.0, 0.0]
    assert got[3:6].abs().min().item() > 0.1


def test_group_advantages_use_the_unbiased_deviation() -> None:
    """[1, 0]: mean 0.5, unbiased std sqrt(0.5) (population std would be 0.5)."""
    got = group_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.0)
    assert got.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_group_advantages_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="do not split into groups"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size must be an integer >= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"rows \[2\] are NaN or infinite"):
        group_advantages(torch.tensor([0.0, 1.0, math.nan, 1.0]), 2)
    with pytest.raises(ValueError, match="1-d floating-point"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="1-d floating-point"):
        group_advantages(torch.tensor([0, 1, 1, 0]), 2)


# --- bad input --------------------------------------------------------------------------------


def test_loss_rejects_bad_input() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    old, adv = torch.zeros(2, 3), torch.zeros(2)
    mask = torch.ones(2, 3, dtype=torch.bool)
    config = GRPOLossConfig()
    with pytest.raises(ValueError, match=r"mask must be a .* bool tensor"):
        grpo_loss(lp, old, adv, mask.float(), config)
    with pytest.raises(ValueError, match="old_logprobs must have the shape of logprobs"):
        grpo_loss(lp, torch.zeros(2, 4), adv, mask, config)
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(lp, old, torch.zeros(2, 3), mask, config)
    with pytest.raises(ValueError, match="logprobs must be a"):
        grpo_loss(torch.zeros(6), old, adv, mask, config)
    with pytest.raises(ValueError, match=r"old_logprobs.detach\(\)"):
        grpo_loss(lp, lp, adv, mask, config)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, old, adv, mask, GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs must have the shape"):
        grpo_loss(lp, old, adv, mask, GRPOLossConfig(kl_coef=0.1), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="normalizer must be a finite number > 0"):
        grpo_loss(lp, old, adv, mask, config, normalizer=0.0)
    with pytest.raises(ValueError, match="mask must be"):
        loss_units(torch.ones(2, 3, dtype=torch.int64), config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_eps": 1.0}, "clip_eps must be in"),
        ({"clip_eps": -0.1}, "clip_eps must be in"),
        ({"clip_eps": math.nan}, "clip_eps must be in"),
        ({"clip_eps_high": -0.1}, "clip_eps_high must be"),
        ({"clip_eps_high": math.inf}, "clip_eps_high must be"),
        ({"kl_coef": -1.0}, "kl_coef must be"),
        ({"loss_aggregation": "sum"}, "loss_aggregation must be one of"),
    ],
)
def test_config_is_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRPOLossConfig(**kwargs)  # type: ignore[arg-type]
