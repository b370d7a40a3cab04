"""GRPO's update on a training rank: one rollout batch, ``minibatches`` optimizer steps.

The loss of each minibatch is the data-parallel share of the global minibatch's loss: every
rank divides its sum by the global count of loss units (sequences or tokens, one sum over the
data-parallel group) over the data-parallel size, because hp-fsdp averages gradients over the
data-parallel ranks (:func:`hp_rl.grpo.grpo_loss`). Tensor-parallel ranks of one data-parallel
rank hold the same rows.

Before the first optimizer step the policy is the one that sampled the batch (when it was
synced for this step), so its log-probabilities should equal the behaviour ones: their
largest and mean absolute difference over response tokens are reported every step (0 in the
consistency mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from hp_dtensor.watchdog import watch
from hp_fsdp import clip_grad_norm_
from hp_offload import OffloadedOptimizer
from hp_rl.experience import Experience
from hp_rl.grpo import GRPOLossConfig, grpo_loss, loss_units
from hp_rl.scoring import sequence_logprobs

__all__ = ["UpdateStats", "grpo_update"]


@dataclass(frozen=True)
class UpdateStats:
    """One batch's update on this rank (means over its minibatches unless said).

    Attributes:
        loss, kl, clip_fraction, ratio_mean: as :class:`hp_rl.grpo.GRPOStats`.
        ratio_max: the largest ratio of any minibatch.
        grad_norm: the global gradient norm before clipping, of the last minibatch.
        logprob_diff_max, logprob_diff_mean: the first minibatch's trainer vs behaviour
            log-probabilities over response tokens (absolute difference).
        tokens: tokens (prompt and response, no padding) of the rows trained on here.
    """

    loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    grad_norm: float
    logprob_diff_max: float
    logprob_diff_mean: float
    tokens: int


def _global_units(units: int, group: dist.ProcessGroup | None) -> int:
    total = torch.tensor([units], dtype=torch.int64)
    if group is not None:
        with watch("grpo loss units all-reduce", group):
            dist.all_reduce(total, group=group)
    return int(total.item())


def grpo_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer | OffloadedOptimizer,
    schedule: LRScheduler,
    experience: Experience,
    *,
    loss_config: GRPOLossConfig,
    minibatches: int,
    temperature: float,
    dp_group: dist.ProcessGroup | None,
    dp_size: int,
    clip_norm: float,
) -> UpdateStats:
    """Train ``policy`` on ``experience`` (this rank's rows) in ``minibatches`` optimizer
    steps (module docstring)."""
    totals = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0}
    ratio_max = -math.inf
    grad_norm = 0.0
    diff_max = diff_mean = 0.0
    policy.train()
    for index, part in enumerate(experience.split(minibatches)):
        units = _global_units(loss_units(part.mask, loss_config), dp_group)
        logprobs = sequence_logprobs(policy, part.tokens, temperature)
        if index == 0:
            diff = (logprobs.detach() - part.old_logprobs)[part.mask].abs()
            if diff.numel():
                diff_max, diff_mean = float(diff.max()), float(diff.mean())
        loss, stats = grpo_loss(
            logprobs,
            part.old_logprobs,
            part.advantages,
            part.mask,
            loss_config,
            part.ref_logprobs,
            normalizer=max(units, 1) / dp_size,
        )
        loss.backward()
        norm = clip_grad_norm_(policy.parameters(), clip_norm if clip_norm > 0 else math.inf)
        grad_norm = float(norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        for name in totals:
            totals[name] += float(getattr(stats, name))
        ratio_max = max(ratio_max, float(stats.ratio_max))
    mask = experience.mask
    prompt_lengths = mask.to(torch.int64).argmax(dim=1) + 1  # the first predicted response
    tokens = int((prompt_lengths + mask.sum(dim=1)).sum())
    return UpdateStats(
        loss=totals["loss"] / minibatches,
        kl=totals["kl"] / minibatches,
        clip_fraction=totals["clip_fraction"] / minibatches,
        ratio_mean=totals["ratio_mean"] / minibatches,
        ratio_max=ratio_max,
        grad_norm=grad_norm,
        logprob_diff_max=diff_max,
        logprob_diff_mean=diff_mean,
        tokens=tokens,
    )
