"""The rollout engine's interface, and the built-in engine behind it.

The trainer asks an engine for four things only (:class:`RolloutEngine`): the tensors the
weight sync writes (each with its global layout: the sync is planned from those layouts),
the policy version those tensors hold, a batch of responses, and, for the consistency mode,
the log-probabilities of given sequences computed as the trainer computes them. An external
engine (vLLM, SGLang) can stand behind the same four where one is installed; the built-in
:class:`BuiltinEngine` (hp-train's model in the rollout layout, :func:`hp_rl.generate.generate`)
is the tested default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from hp_layout import Layout
from hp_rl.generate import Generation, generate
from hp_rl.models import local_layouts
from hp_rl.sampling import SamplingParams
from hp_rl.scoring import sequence_logprobs

__all__ = ["NO_VERSION", "BuiltinEngine", "RolloutEngine"]

#: The policy version of an engine whose weights no sync has written yet.
NO_VERSION = -1


class RolloutEngine(Protocol):
    """What the GRPO trainer needs of a rollout engine.

    Attributes:
        policy_version: the version of the policy the engine's weights are (set by the trainer
            after each committed sync; :data:`NO_VERSION` before the first).
    """

    policy_version: int

    def tensors(self) -> dict[str, tuple[Layout, torch.Tensor]]:
        """Every weight by name: its layout over the rollout ranks and this rank's local
        tensor, which the weight sync overwrites in place."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator
    ) -> Generation:
        """Responses to ``prompts`` and their log-probabilities."""
        ...

    def score(self, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """``[B, T - 1]``: the log-probability of each next token of ``tokens``, computed as
        the trainer computes it (:func:`hp_rl.scoring.sequence_logprobs`)."""
        ...


class BuiltinEngine:
    """hp-train's model in the rollout layout (:func:`hp_rl.models.build_rollout_model`),
    generating with :func:`hp_rl.generate.generate`.

    Args:
        model: the rollout model on this rank.
        pad_id: the id padding responses.
        group: this replica's tensor-parallel group (None without tensor parallelism); each
            generation then checks that the group's ranks produced the same tokens.
    """

    def __init__(
        self, model: nn.Module, *, pad_id: int, group: dist.ProcessGroup | None = None
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        self.group = group
        self.policy_version = NO_VERSION

    def tensors(self) -> dict[str, tuple[Layout, torch.Tensor]]:
        """The rollout model's parameters (see :class:`RolloutEngine`)."""
        return local_layouts(self.model)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator
    ) -> Generation:
        """Batched generation with a KV cache (:func:`hp_rl.generate.generate`)."""
        return generate(
            self.model, prompts, params, generator, pad_id=self.pad_id, group=self.group
        )

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        """One ordinary forward of the rollout model (the consistency mode's re-scoring)."""
        return sequence_logprobs(self.model, tokens, temperature)
