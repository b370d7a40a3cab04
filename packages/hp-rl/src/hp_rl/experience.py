"""A rollout batch ready for GRPO's update, and the checks on its age.

:class:`Experience` holds one batch's rows (prompt + response tokens, the response mask, the
behaviour and reference log-probabilities, the advantages and rewards) and the policy version
that sampled it. Rows of one prompt's group are contiguous. Batches from several rollout
replicas are joined (:func:`concat`) and cut into the data-parallel ranks' slices and the
optimizer steps' minibatches by rows (:meth:`Experience.rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hp_rl.generate import Generation
from hp_rl.scoring import Sequences

__all__ = ["Experience", "StaleRolloutError", "behaviour_logprobs", "check_fresh", "concat"]


class StaleRolloutError(RuntimeError):
    """A rollout older than the run's ``max_lag`` reached the update."""


def check_fresh(policy_version: int, step: int, max_lag: int) -> None:
    """Refuse a rollout sampled by policy version ``policy_version`` for the update of step
    ``step`` when ``step - policy_version > max_lag`` (or when it comes from the future, or
    from an engine no sync ever wrote: version < 0).

    Raises:
        StaleRolloutError: naming both versions and the limit.
    """
    lag = step - policy_version
    if policy_version < 0 or lag < 0 or lag > max_lag:
        raise StaleRolloutError(
            f"the rollout for step {step} was sampled by policy version {policy_version}: a lag "
            f"of {lag} steps, outside 0..max_lag={max_lag}; the rollout weights were not synced "
            "as the run's sync_every promises"
        )


@dataclass(frozen=True)
class Experience:
    """One rollout batch of ``B`` rows.

    Attributes:
        tokens: ``[B, T]`` prompt then response, right-padded.
        mask: ``[B, T - 1]`` bool, the predicted positions that are response tokens.
        old_logprobs: ``[B, T - 1]`` the behaviour policy's log-probabilities at those
            positions (0 elsewhere).
        advantages: ``[B]`` group-relative advantages.
        rewards: ``[B]`` the task's rewards.
        ref_logprobs: ``[B, T - 1]`` the reference policy's, or None without a KL term.
        policy_version: the policy version that sampled every row.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    ref_logprobs: torch.Tensor | None
    policy_version: int

    @property
    def size(self) -> int:
        """Rows."""
        return int(self.tokens.shape[0])

    def rows(self, start: int, stop: int) -> Experience:
        """Rows ``start .. stop - 1`` (the same columns)."""
        ref = None if self.ref_logprobs is None else self.ref_logprobs[start:stop]
        return Experience(
            tokens=self.tokens[start:stop],
            mask=self.mask[start:stop],
            old_logprobs=self.old_logprobs[start:stop],
            advantages=self.advantages[start:stop],
            rewards=self.rewards[start:stop],
            ref_logprobs=ref,
            policy_version=self.policy_version,
        )

    def split(self, parts: int) -> list[Experience]:
        """``parts`` consecutive slices of equal rows.

        Raises:
            ValueError: the rows do not divide evenly.
        """
        if self.size % parts:
            raise ValueError(f"{self.size} rows cannot be split into {parts} equal parts")
        step = self.size // parts
        return [self.rows(i * step, (i + 1) * step) for i in range(parts)]


def behaviour_logprobs(generation: Generation, sequences: Sequences) -> torch.Tensor:
    """The engine's sampling log-probabilities placed where :func:`hp_rl.scoring.join` put
    their tokens: ``[B, T - 1]``, each row's response log-probabilities at its masked
    positions in order, 0 elsewhere."""
    out = torch.zeros(sequences.response_mask.shape, dtype=torch.float32)
    for i, length in enumerate(generation.response_lengths.tolist()):
        out[i, sequences.response_mask[i]] = generation.response_logprobs[i, :length]
    return out


def _pad_columns(t: torch.Tensor, columns: int, value: float | int | bool) -> torch.Tensor:
    return F.pad(t, (0, columns - t.shape[1]), value=value)


def concat(parts: Sequence[Experience], pad_id: int) -> Experience:
    """``parts``' rows in order, right-padded to the longest (pad tokens, masked out).

    Raises:
        ValueError: no part, or parts of different policy versions.
    """
    if not parts:
        raise ValueError("concat needs at least one Experience")
    versions = {p.policy_version for p in parts}
    if len(versions) != 1:
        raise ValueError(f"one batch is sampled by one policy version, got {sorted(versions)}")
    width = max(p.tokens.shape[1] for p in parts)
    has_ref = [p.ref_logprobs is not None for p in parts]
    if any(has_ref) and not all(has_ref):
        raise ValueError("either every part has reference log-probabilities or none")
    ref = (
        torch.cat([_pad_columns(p.ref_logprobs, width - 1, 0.0) for p in parts])  # type: ignore[arg-type]
        if all(has_ref)
        else None
    )
    return Experience(
        tokens=torch.cat([_pad_columns(p.tokens, width, pad_id) for p in parts]),
        mask=torch.cat([_pad_columns(p.mask, width - 1, False) for p in parts]),
        old_logprobs=torch.cat([_pad_columns(p.old_logprobs, width - 1, 0.0) for p in parts]),
        advantages=torch.cat([p.advantages for p in parts]),
        rewards=torch.cat([p.rewards for p in parts]),
        ref_logprobs=ref,
        policy_version=parts[0].policy_version,
    )
