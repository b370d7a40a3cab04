"""The one configuration of a GRPO run (``python -m hp_rl``): a frozen :class:`RLConfig`,
validated as a whole, read from a TOML file's ``[rl]`` table and overridden by flags.

Fields group by concern: the model and data (``init_from``, ``tokenizer``, the task), the
layouts (training, rollout, placement), the sync, GRPO's sampling and loss, the optimizer,
and the run (steps, output, logging, checkpoints).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hp_rl.grpo import GRPOLossConfig
from hp_rl.roles import PLACEMENTS
from hp_rl.sampling import SamplingParams
from hp_rl.weight_sync.plan import METHODS

__all__ = ["CONFIG_TABLE", "RLConfig", "RLConfigError", "load_config"]

#: The TOML table of a config file.
CONFIG_TABLE = "rl"


class RLConfigError(ValueError):
    """A configuration that cannot run, with what is wrong and what would be right."""


@dataclass(frozen=True)
class RLConfig:
    """A GRPO run.

    Attributes:
        init_from: a Hugging Face folder (hp-train's export of the supervised warm-up) the
            policy, and the reference, start from; None: a randomly initialized ``model``.
        model: an hp-train preset name for a random start (tests), when ``init_from`` is None.
        tokenizer: the tokenizer folder (``tokenizer.json``) the warm-up trained with.
        max_operand, operations: the arithmetic task (:class:`hp_rl.tasks.ArithmeticTask`).
        placement: ``"colocated"`` (every rank trains and rolls out) or ``"disaggregated"``.
        dp_replicate, dp_shard, tp: the training layout (``dp_shard=-1``: the rest).
        param_layout: FSDP's storage, ``"flat"`` or ``"per_param"``.
        rollout_tp: ranks per rollout engine replica (tensor parallelism inside it).
        rollout_ranks: with ``"disaggregated"``, the ranks that roll out (the last ones).
        sync_method: ``"direct"`` (hp-layout's transfer plan) or ``"full_gather"``.
        sync_every: sync the rollout weights every N steps (1: on-policy).
        max_lag: refuse a rollout made more than this many steps before the step that trains
            on it (a rollout at policy version v trained at step s needs ``s - v <= max_lag``).
        consistency: re-score every rollout with the trainer's kernels in the rollout layout,
            so the behaviour log-probabilities equal the trainer's bit for bit (the training
            and rollout layouts must then split the model alike: ``tp == rollout_tp`` and as
            many rollout replicas as data-parallel ranks).
        steps: GRPO steps (one rollout batch each).
        prompts_per_step: prompts per step, over the whole job.
        group_size: responses sampled per prompt (GRPO's group).
        minibatches: optimizer steps per rollout batch (the batch split into this many; the
            ratio leaves 1, and the clip matters, from the second on).
        max_new_tokens, temperature, top_k, top_p: sampling (:class:`SamplingParams`).
        clip_eps, clip_eps_high, kl_coef, loss_aggregation: the loss (:class:`GRPOLossConfig`).
        optimizer, lr, muon_lr, weight_decay, clip_grad_norm, warmup_steps: as hp-train's.
        offload_optimizer: keep the optimizer state in host memory between updates
            (``hp_offload.OffloadedOptimizer``), so that a colocated engine generates while
            only the weights occupy the device; AdamW only (Muon's step exchanges matrices
            between ranks, which a step bucket by bucket cannot do).
        seed: prompts, sampling and the random start; every random draw of step ``s`` is a
            function of ``(seed, s)``, so a resume needs only the step.
        out: the run's folder (metrics.jsonl, checkpoints, reward curve).
        tensorboard: also write the metrics as TensorBoard events into ``<out>/tensorboard``
            (needs the ``tensorboard`` package: ``pip install hp-rl[tensorboard]``).
        log_every: print a line every N steps.
        checkpoint_every: save every N steps (0: never).
        eval_every: greedy accuracy on held-out problems every N steps and after the last
            (0: never); eval_prompts: how many.
    """

    init_from: str | None = None
    model: str = "tiny"
    tokenizer: str | None = None
    max_operand: int = 99
    operations: tuple[str, ...] = ("+",)
    placement: str = "colocated"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    param_layout: str = "flat"
    rollout_tp: int = 1
    rollout_ranks: int = 0
    sync_method: str = "direct"
    sync_every: int = 1
    max_lag: int = 0
    consistency: bool = False
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 2
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    loss_aggregation: str = "sequence_mean"
    optimizer: str = "muon"
    lr: float = 3e-4
    muon_lr: float = 0.005
    weight_decay: float = 0.0
    clip_grad_norm: float = 1.0
    warmup_steps: int = 0
    seed: int = 0
    offload_optimizer: bool = False
    out: str = "runs/grpo"
    tensorboard: bool = False
    log_every: int = 1
    checkpoint_every: int = 0
    eval_every: int = 0
    eval_prompts: int = 64

    def __post_init__(self) -> None:
        self.sampling()  # SamplingParams and GRPOLossConfig validate their own fields
        self.loss()
        choices = {
            "placement": PLACEMENTS,
            "sync_method": METHODS,
            "param_layout": ("flat", "per_param"),
            "optimizer": ("muon", "adamw"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise RLConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        positive = ("steps", "prompts_per_step", "sync_every", "minibatches", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise RLConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_lag", "checkpoint_every", "eval_every", "eval_prompts", "warmup_steps"):
            if getattr(self, name) < 0:
                raise RLConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.group_size < 2:
            raise RLConfigError(
                f"group_size must be >= 2 (GRPO compares each response with the others of its "
                f"group), got {self.group_size}"
            )
        if self.sync_every - 1 > self.max_lag:
            raise RLConfigError(
                f"sync_every={self.sync_every} trains on rollouts up to {self.sync_every - 1} "
                f"steps old, beyond max_lag={self.max_lag}: raise max_lag to "
                f"{self.sync_every - 1} or sync more often"
            )
        if self.offload_optimizer and self.optimizer != "adamw":
            raise RLConfigError(
                f"offload_optimizer steps the optimizer bucket by bucket, which needs an update "
                f"of each parameter from its own state alone: optimizer 'adamw', not "
                f"{self.optimizer!r} (Muon exchanges whole matrices between ranks)"
            )
        if self.consistency and self.tp != self.rollout_tp:
            raise RLConfigError(
                f"consistency needs the same tensor-parallel split on both sides (the same "
                f"kernels on the same shards): tp={self.tp}, rollout_tp={self.rollout_tp}"
            )

    def sampling(self) -> SamplingParams:
        """The rollout's sampling parameters (stop tokens added by the trainer)."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
        )

    def loss(self) -> GRPOLossConfig:
        """GRPO's loss configuration."""
        return GRPOLossConfig(
            clip_eps=self.clip_eps,
            clip_eps_high=self.clip_eps_high,
            kl_coef=self.kl_coef,
            loss_aggregation=self.loss_aggregation,  # type: ignore[arg-type]
        )

    def replace(self, **changes: Any) -> RLConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in fields(RLConfig)}


def _coerce(name: str, value: Any) -> Any:
    if name == "operations" and isinstance(value, list | str):
        return tuple(value) if isinstance(value, list) else tuple(value.split(","))
    return value


def load_config(path: str | Path | None, overrides: Mapping[str, Any]) -> RLConfig:
    """The config of the TOML file ``path`` (its ``[rl]`` table; None: the defaults), with
    ``overrides`` (field name to value; None values ignored) on top.

    Raises:
        RLConfigError: an unknown field, an unreadable file, or a value the config refuses.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RLConfigError(f"cannot read the config file {path}: {exc}") from None
        table = raw.get(CONFIG_TABLE, {})
        unknown_tables = sorted(set(raw) - {CONFIG_TABLE})
        if unknown_tables:
            raise RLConfigError(
                f"{path}: tables {unknown_tables} are not hp-rl's; put every setting in [rl]"
            )
        values.update(table)
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise RLConfigError(f"unknown settings {unknown}; the settings are {sorted(_FIELDS)}")
    try:
        return RLConfig(**{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        if isinstance(exc, RLConfigError):
            raise
        raise RLConfigError(str(exc)) from None
