"""hp_rl: training and inference in one framework.

GRPO on hp-train's models and optimizers (:class:`GRPOTrainer`, ``python -m hp_rl``), with a
built-in rollout engine (:class:`BuiltinEngine`: batched generation with a KV cache and seeded
sampling, :func:`hp_rl.generate.generate`, in a layout of its own, behind the small
:class:`RolloutEngine` interface) and a weight sync from the training layout to the rollout
layout that hp-layout plans once per job (:func:`hp_layout.plan_transfer`, executed all or
nothing by :class:`WeightSync`).
"""

from hp_rl.config import RLConfig, RLConfigError, load_config
from hp_rl.engine import NO_VERSION, BuiltinEngine, RolloutEngine
from hp_rl.experience import Experience, StaleRolloutError, check_fresh
from hp_rl.generate import Generation
from hp_rl.grpo import GRPOLossConfig, GRPOStats, group_advantages, grpo_loss
from hp_rl.roles import JobRoles, RolesError, plan_roles
from hp_rl.sampling import SamplingParams, sample_next
from hp_rl.scoring import Sequences, join, sequence_logprobs
from hp_rl.tasks.arithmetic import ArithmeticTask, Problem
from hp_rl.trainer import GRPOTrainer
from hp_rl.weight_sync import (
    SyncFailedError,
    SyncMismatchError,
    SyncPlan,
    SyncResult,
    WeightSync,
    connect_weight_sync,
    plan_sync,
)

__version__ = "0.1.0"

__all__ = [
    "NO_VERSION",
    "ArithmeticTask",
    "BuiltinEngine",
    "Experience",
    "GRPOLossConfig",
    "GRPOStats",
    "GRPOTrainer",
    "Generation",
    "JobRoles",
    "Problem",
    "RLConfig",
    "RLConfigError",
    "RolesError",
    "RolloutEngine",
    "SamplingParams",
    "Sequences",
    "StaleRolloutError",
    "SyncFailedError",
    "SyncMismatchError",
    "SyncPlan",
    "SyncResult",
    "WeightSync",
    "__version__",
    "check_fresh",
    "connect_weight_sync",
    "group_advantages",
    "grpo_loss",
    "join",
    "load_config",
    "plan_roles",
    "plan_sync",
    "sample_next",
    "sequence_logprobs",
]
