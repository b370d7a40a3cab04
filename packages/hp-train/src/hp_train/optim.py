"""The optimizer (Muon on matrices + AdamW on the rest, or AdamW alone) and its schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from hp_muon import MuonStepPlan, muon_with_adamw, split_params
from hp_train.config.schema import TrainConfig

__all__ = ["ROUTER_PATTERNS", "build_optimizer", "build_schedule", "lr_factor"]

#: MoE routers are small scoring layers: AdamW, as in Moonlight and DeepSeek-V3's Muon ports.
ROUTER_PATTERNS: tuple[str, ...] = ("*.router.*",)
ADAMW_BETAS = (0.9, 0.95)


def build_optimizer(
    model: nn.Module, config: TrainConfig, *, muon_plan: MuonStepPlan | None = None
) -> torch.optim.Optimizer:
    """Muon (``match_rms_adamw`` lr adjustment, so both share the weight decay scale) on the
    block matrices and expert stacks; AdamW on embeddings, norms, routers and the LM head.
    ``config.optimizer == "adamw"``: AdamW on everything. ``muon_plan``: the run's planned
    Muon step (hp-planner's), which Muon checks its own against at the first step."""
    adamw = {"lr": config.lr, "weight_decay": config.weight_decay, "betas": ADAMW_BETAS}
    optimizer: torch.optim.Optimizer
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)  # type: ignore[arg-type]
    else:
        split = split_params(model, adamw_patterns=ROUTER_PATTERNS)
        muon = {
            "lr": config.muon_lr,
            "weight_decay": config.weight_decay,
            "adjust_lr_fn": "match_rms_adamw",
        }
        if muon_plan is not None:
            muon["plan"] = muon_plan
        optimizer = muon_with_adamw(model, muon=muon, adamw=adamw, split=split)
    # The schedule scales each group's peak: record it in the group itself, so that it is
    # there before (and whatever) a checkpoint's groups restore.
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def lr_factor(step: int, config: TrainConfig) -> float:
    """The multiplier of the peak lr for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` (step 0 gets ``1 / (warmup_steps + 1)``), then cosine decay to
    ``min_lr_ratio`` at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    span = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def build_schedule(
    optimizer: torch.optim.Optimizer, config: TrainConfig, start_step: int = 0
) -> LambdaLR:
    """A scheduler applying :func:`lr_factor` to each group's ``initial_lr`` (its peak, set by
    :func:`build_optimizer`), positioned at ``start_step`` (for resumes: the schedule is a
    function of the step, so nothing of it needs saving).

    Raises:
        ValueError: a group without ``initial_lr``.
    """
    for i, group in enumerate(optimizer.param_groups):
        if "initial_lr" not in group:
            raise ValueError(
                f"param group {i} has no 'initial_lr' (its peak lr); build the optimizer with "
                "hp_train.optim.build_optimizer or set it"
            )
    schedule = LambdaLR(optimizer, lambda step: lr_factor(step, config), last_epoch=start_step - 1)
    return schedule
