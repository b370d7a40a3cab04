"""GRPO's mathematics: group-relative advantages and the clipped policy loss.

Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024) replaces PPO's learned
value baseline by the other answers to the same prompt: every prompt is answered ``G`` times,
each answer's reward is compared with its group's (:func:`group_advantages`), and the policy
is updated with PPO's clipped surrogate on every response token, optionally with a KL penalty
to a reference policy (:func:`grpo_loss`).

Everything here is pure tensor arithmetic with no communication: a data-parallel caller counts
its local loss units (:func:`loss_units`), sums them over the ranks itself and passes the
divisor as ``normalizer`` (see :func:`grpo_loss` for which divisor an averaging trainer needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "GRPOLossConfig",
    "GRPOStats",
    "LossAggregation",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "loss_units",
]

#: How per-token losses become one number: ``"sequence_mean"`` (the mean over each sequence's
#: response tokens, then over sequences: GRPO's original) or ``"token_mean"`` (one mean over
#: every response token of the batch: longer answers weigh more, as in DAPO).
LossAggregation = Literal["sequence_mean", "token_mean"]


def group_advantages(
    rewards: Tensor, group_size: int, *, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """Each answer's reward relative to the other answers to the same prompt.

    ``rewards`` is ``[n_groups * group_size]`` with groups contiguous: rows ``g * G`` to
    ``g * G + G - 1`` answer prompt ``g``. The advantage of row ``i`` of group ``g`` is
    ``(r_i - mean_g) / (std_g + eps)``, where ``std_g`` is the *unbiased* (Bessel-corrected,
    divisor ``G - 1``) standard deviation of the group. DeepSeekMath's paper writes
    ``std(r)`` without saying which; the unbiased one is what ``torch.std`` computes and what
    the widely used open implementations (Hugging Face TRL's ``GRPOTrainer``, verl) divide by,
    so results compare with theirs. ``scale=False`` only centres (``r_i - mean_g``: Dr. GRPO,
    which drops the division because it over-weights groups with small spread).

    A group whose rewards are all equal carries no signal: its advantages are exactly 0 (not
    a rounding residue divided by ``eps``).

    Returns:
        float32 advantages, the shape and device of ``rewards``.

    Raises:
        ValueError: ``group_size`` not an integer >= 2 (one answer has nothing to compare
            with); ``rewards`` not 1-d floating point; a length that is not a multiple of
            ``group_size``; a NaN or infinite reward; ``eps`` negative.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an integer >= 2 (answers per prompt, compared with each "
            f"other), got {group_size!r}"
        )
    if not (isinstance(eps, float | int) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a 1-d floating-point tensor [n_groups * group_size], got shape "
            f"{tuple(rewards.shape)} dtype {rewards.dtype}"
        )
    n = rewards.numel()
    if n % group_size:
        raise ValueError(
            f"{n} rewards do not split into groups of group_size={group_size}: pass "
            f"n_groups * group_size rewards, each prompt's {group_size} answers contiguous"
        )
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; rows {bad} are NaN or infinite")
    # float64: a group's mean and spread of nearly equal rewards stay exact enough.
    grouped = rewards.detach().to(torch.float64).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    advantages = torch.where(constant, torch.zeros_like(centred), centred)
    return advantages.view(-1).to(torch.float32)


@dataclass(frozen=True)
class GRPOLossConfig:
    """The knobs of :func:`grpo_loss`.

    Attributes:
        clip_eps: the ratio is clipped below at ``1 - clip_eps`` (in ``[0, 1)``).
        clip_eps_high: the ratio is clipped above at ``1 + clip_eps_high``; None: ``clip_eps``
            (a larger value is DAPO's "clip higher", leaving room for unlikely tokens to grow).
        kl_coef: the weight of the KL penalty to the reference policy (k3 estimator,
            :func:`k3_kl`); 0 turns it off. Must be finite and >= 0.
        loss_aggregation: see :data:`LossAggregation`.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    loss_aggregation: LossAggregation = "sequence_mean"

    def __post_init__(self) -> None:
        if not _is_real(self.clip_eps) or not 0 <= self.clip_eps < 1:
            raise ValueError(
                f"clip_eps must be in [0, 1) (the ratio's lower bound 1 - clip_eps must stay "
                f"positive), got {self.clip_eps!r}"
            )
        if self.clip_eps_high is not None and (
            not _is_real(self.clip_eps_high) or not 0 <= self.clip_eps_high < math.inf
        ):
            raise ValueError(
                f"clip_eps_high must be a finite number >= 0 or None (= clip_eps), got "
                f"{self.clip_eps_high!r}"
            )
        if not _is_real(self.kl_coef) or not 0 <= self.kl_coef < math.inf:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if self.loss_aggregation not in get_args(LossAggregation):
            raise ValueError(
                f"loss_aggregation must be one of {get_args(LossAggregation)}, got "
                f"{self.loss_aggregation!r}"
            )

    @property
    def upper_eps(self) -> float:
        """The ratio's upper clip offset: ``clip_eps_high``, or ``clip_eps`` when None."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def _is_real(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and value == value


@dataclass(frozen=True)
class GRPOStats:
    """What one :func:`grpo_loss` call saw, for logging. Every field is a detached float32
    0-d tensor on the loss's device (no host synchronisation until it is read), and every
    field but the first three describes this call's response tokens only (this rank's, under
    data parallelism).

    Attributes:
        loss: the returned loss, ``policy_loss + kl_loss``.
        policy_loss: the clipped-surrogate part, aggregated like the loss.
        kl_loss: ``kl_coef`` times the k3 terms, aggregated like the loss (0 without a penalty).
        kl: the mean of k3 over response tokens (0 when no reference was given).
        clip_fraction: the fraction of response tokens where the clip is active, i.e. where
            the clipped term is the one kept and carries no gradient (positive advantage with
            the ratio above ``1 + clip_eps_high``, or negative advantage with the ratio below
            ``1 - clip_eps``).
        ratio_mean: the mean of ``exp(logprobs - old_logprobs)`` over response tokens (1
            when there is none).
        ratio_max: its maximum (1 when there is no response token).
        ratio_min: its minimum (1 when there is no response token).
        tokens: the number of response tokens.
        sequences: the number of sequences with at least one response token.
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    kl: Tensor
    clip_fraction: Tensor
    ratio_mean: Tensor
    ratio_max: Tensor
    ratio_min: Tensor
    tokens: Tensor
    sequences: Tensor


def k3_kl(ref_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of ``KL(policy || reference)`` per sampled token:
    ``exp(ref - lp) - (ref - lp) - 1``, elementwise.

    Unbiased for the KL when tokens are sampled from the policy, and never negative
    (``e^x >= 1 + x``), 0 exactly where the two log-probabilities agree.
    """
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1


def loss_units(mask: Tensor, config: GRPOLossConfig) -> int:
    """What :func:`grpo_loss` divides by when given no ``normalizer``: the number of
    sequences with at least one response token (``"sequence_mean"``) or of response tokens
    (``"token_mean"``) in ``mask`` (``[B, T]`` bool).

    A data-parallel caller all-reduces (sums) this over its ranks to get the global batch's
    count (see :func:`grpo_loss`).
    """
    _check_mask(mask)
    if config.loss_aggregation == "sequence_mean":
        return int(mask.any(dim=1).sum())
    return int(mask.sum())


def _check_mask(mask: Tensor) -> None:
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(
            f"mask must be a [B, T] bool tensor (True on response tokens), got shape "
            f"{tuple(mask.shape)} dtype {mask.dtype}: use mask.bool() or a comparison"
        )


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    config: GRPOLossConfig,
) -> None:
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(
            f"logprobs must be a [B, T] floating-point tensor (the policy's log-probabilities "
            f"of the sampled tokens), got shape {tuple(logprobs.shape)} dtype {logprobs.dtype}"
        )
    shape = tuple(logprobs.shape)
    _check_mask(mask)
    named: dict[str, Tensor | None] = {
        "old_logprobs": old_logprobs,
        "mask": mask,
        "ref_logprobs": ref_logprobs,
    }
    for name, tensor in named.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {shape}, got {tuple(tensor.shape)}"
            )
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {shape[:1]} (one per sequence; a token-level advantage "
            f"is not GRPO's), got {tuple(advantages.shape)}"
        )
    for name, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
    for name, tensor in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("ref_logprobs", ref_logprobs),
    ):
        if tensor is not None and tensor.requires_grad:
            raise ValueError(
                f"{name} requires grad: it is a fixed target of the update, pass "
                f"{name}.detach() (a gradient through it would change the objective)"
            )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"kl_coef={config.kl_coef} needs ref_logprobs (the reference policy's "
            "log-probabilities of the sampled tokens); pass them or set kl_coef=0"
        )


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOLossConfig,
    ref_logprobs: Tensor | None = None,
    *,
    normalizer: float | None = None,
) -> tuple[Tensor, GRPOStats]:
    """GRPO's clipped policy loss (to minimise) and its statistics.

    Per response token (``mask`` True), with ``A`` its sequence's advantage::

        ratio     = exp(logprobs - old_logprobs)
        surrogate = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
        loss_tok  = -surrogate + kl_coef * k3(ref_logprobs, logprobs)

    Aggregation (``config.loss_aggregation``): ``"sequence_mean"`` takes the mean of
    ``loss_tok`` over each sequence's response tokens, then sums those over sequences;
    ``"token_mean"`` sums ``loss_tok`` over every response token. Either sum is divided by
    ``normalizer``, which defaults to :func:`loss_units` of ``mask``: the number of sequences
    with a response token, or of response tokens, so the result is the mean. A sequence with
    no response token contributes 0 and is not counted. Padded positions never enter: their
    log-probabilities may hold anything, even NaN or infinity.

    Data parallelism: each rank holds some of the global batch's sequences. With
    ``normalizer = N``, the global count (the sum of :func:`loss_units` over the ranks), each
    rank's loss is its share, and the *sum* over ranks of the local losses (and of their
    gradients) is the global batch's loss (and gradient). Trainers that *average* gradients
    over the ``W`` data-parallel ranks (hp-fsdp and torch DDP/FSDP reduce with a mean) need
    ``normalizer = N / W``: each local loss is then ``W`` times its share, and the average
    of the ranks' gradients is the global gradient.

    Args:
        logprobs: ``[B, T]`` the current policy's log-probabilities of the sampled tokens
            (with grad).
        old_logprobs: ``[B, T]`` the behaviour policy's (the one that sampled), detached.
        advantages: ``[B]`` one per sequence (:func:`group_advantages`), detached.
        mask: ``[B, T]`` bool, True on response tokens.
        config: clip range, KL weight, aggregation.
        ref_logprobs: ``[B, T]`` the reference policy's, detached; needed when ``kl_coef > 0``
            (given with ``kl_coef == 0`` only the ``kl`` statistic uses it).
        normalizer: the divisor (see above); must be > 0.

    Returns:
        ``(loss, stats)``: a float32 0-d tensor (0 with a zero gradient when the mask holds
        no response token and no normalizer is given), and :class:`GRPOStats`.

    Raises:
        ValueError: shapes that disagree; a mask that is not bool; non-floating inputs;
            ``old_logprobs``, ``advantages`` or ``ref_logprobs`` requiring grad; ``kl_coef > 0``
            without ``ref_logprobs``; a ``normalizer`` that is not a finite positive number.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, config)
    _check_normalizer(normalizer)
    # Padded positions are replaced by 0 before any arithmetic: garbage there (NaN, inf) would
    # otherwise reach the loss as inf * 0 = NaN, or the gradient as 0 * NaN through exp.
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = torch.where(mask, logprobs.float(), zero)
    ratio = torch.exp(lp - torch.where(mask, old_logprobs.float(), zero))
    adv = advantages.float().unsqueeze(1)
    low, high = 1.0 - config.clip_eps, 1.0 + config.upper_eps
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, low, high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    policy_tok = -surrogate
    if ref_logprobs is not None:
        k3_tok = k3_kl(torch.where(mask, ref_logprobs.float(), zero), lp)
    else:
        k3_tok = torch.zeros_like(lp)
    kl_tok = config.kl_coef * k3_tok
    weights, units, has_tokens = _token_weights(mask, config)
    divisor: Tensor | float = units.clamp(min=1) if normalizer is None else float(normalizer)
    policy_loss = (policy_tok * weights).sum() / divisor
    kl_loss = (kl_tok * weights).sum() / divisor
    loss = policy_loss + kl_loss
    stats = _stats(loss, policy_loss, kl_loss, k3_tok, ratio, adv, mask, low, high, has_tokens)
    return loss, stats


def _check_normalizer(normalizer: float | None) -> None:
    if normalizer is not None and not (_is_real(normalizer) and 0 < normalizer < math.inf):
        raise ValueError(
            f"normalizer must be a finite number > 0 (the global batch's sequences or tokens, "
            f"divided by the data-parallel size for averaging trainers), got {normalizer!r}"
        )


def _token_weights(mask: Tensor, config: GRPOLossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's weight in the aggregated sum, the number of loss units (sequences with a
    response token, or response tokens) and which sequences have one."""
    maskf = mask.float()
    tokens_per_seq = maskf.sum(dim=1)
    has_tokens = tokens_per_seq > 0
    if config.loss_aggregation == "sequence_mean":
        # Each sequence's mean over its own response tokens; an empty one divides 0 by 1.
        weights = maskf / tokens_per_seq.clamp(min=1).unsqueeze(1)
        units = has_tokens.sum()
    else:
        weights = maskf
        units = maskf.sum()
    return weights, units, has_tokens


def _stats(
    loss: Tensor,
    policy_loss: Tensor,
    kl_loss: Tensor,
    k3_tok: Tensor,
    ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    low: float,
    high: float,
    has_tokens: Tensor,
) -> GRPOStats:
    with torch.no_grad():
        n = mask.sum()
        denom = n.clamp(min=1).float()
        ratio = ratio.detach()
        clip_active = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
        one = torch.ones((), device=ratio.device)
        any_token = n > 0
        return GRPOStats(
            loss=loss.detach(),
            policy_loss=policy_loss.detach(),
            kl_loss=kl_loss.detach(),
            kl=torch.where(mask, k3_tok.detach(), 0.0).sum() / denom,
            clip_fraction=(clip_active & mask).sum().float() / denom,
            ratio_mean=torch.where(any_token, torch.where(mask, ratio, 0.0).sum() / denom, one),
            ratio_max=torch.where(any_token, torch.where(mask, ratio, -math.inf).amax(), one),
            ratio_min=torch.where(any_token, torch.where(mask, ratio, math.inf).amin(), one),
            tokens=n.float(),
            sequences=has_tokens.sum().float(),
        )
