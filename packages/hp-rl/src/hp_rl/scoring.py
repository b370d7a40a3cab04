"""Scoring finished rollouts: joined sequences and their per-token log-probabilities.

:func:`join` lays prompts and responses out as the trainer's sequences with a mask of the
response positions; :func:`sequence_logprobs` is the one function both sides compute
log-probabilities with: the trainer on its FSDP x TP policy (with autograd), and, in
consistency mode, the rollout side on its own model, so both are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hp_rl.generate import Generation

__all__ = ["Sequences", "join", "sequence_logprobs"]


@dataclass(frozen=True)
class Sequences:
    """Prompts and responses joined, ``B`` rows.

    Attributes:
        tokens: ``[B, T]`` int64, each row its prompt then its response, right-padded with
            ``pad_id``.
        response_mask: ``[B, T - 1]`` bool, True where ``tokens[:, 1:]`` is a response token:
            the predicted positions that count in the loss.
    """

    tokens: Tensor
    response_mask: Tensor


def join(prompts: Sequence[Sequence[int]], generation: Generation, pad_id: int) -> Sequences:
    """``prompts`` and ``generation``'s responses as :class:`Sequences` (on the responses'
    device).

    Raises:
        ValueError: the prompts do not match ``generation.prompt_lengths`` (count or lengths).
    """
    lengths = [len(p) for p in prompts]
    if lengths != generation.prompt_lengths.tolist():
        raise ValueError(
            f"join: the prompts' lengths {lengths} differ from the generation's "
            f"prompt_lengths {generation.prompt_lengths.tolist()}; pass the prompts the "
            "generation was made from"
        )
    device = generation.response.device
    responses = generation.response_lengths.tolist()
    total = max(p + r for p, r in zip(lengths, responses, strict=True))
    tokens = torch.full((len(lengths), total), pad_id, dtype=torch.int64, device=device)
    mask = torch.zeros((len(lengths), total - 1), dtype=torch.bool, device=device)
    for i, (prompt, p, r) in enumerate(zip(prompts, lengths, responses, strict=True)):
        tokens[i, :p] = torch.tensor(list(prompt), dtype=torch.int64, device=device)
        tokens[i, p : p + r] = generation.response[i, :r]
        # Position j predicts tokens[j + 1]: the response tokens p .. p + r - 1 are predicted
        # at positions p - 1 .. p + r - 2.
        mask[i, p - 1 : p + r - 1] = True
    return Sequences(tokens=tokens, response_mask=mask)


def sequence_logprobs(model: nn.Module, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """``[B, T - 1]`` float32: the log-probability of each next token ``tokens[:, 1:]``,
    ``log_softmax(model(tokens[:, :-1]).float() / temperature)`` at it.

    One ordinary forward of ``model`` (whatever its layout: FSDP x TP on the trainer, whole or
    TP on the rollout side), with autograd when grad is enabled: the trainer calls it for the
    policy's loss. Pass the sampling temperature (1 for greedy rollouts) so the values are
    those :func:`hp_rl.sampling.sample_next` returned for the same tokens.

    Raises:
        ValueError: ``tokens`` is not ``[B, T]`` with ``T >= 2``, or ``temperature`` is not a
            finite positive number.
    """
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, T] with T >= 2, got {tuple(tokens.shape)}")
    t = temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    logits = model(tokens[:, :-1]).float()
    if t != 1.0:
        logits = logits / t
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
