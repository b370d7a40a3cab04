"""How the rollout engine picks the next token: temperature, top-k, top-p, greedy.

:class:`SamplingParams` holds one request's settings (validated when built);
:func:`sample_next` turns a batch of last-position logits into one token per row and the
log-probability the trainer will compute for that same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SamplingParams", "filter_logits", "sample_next"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generation request.

    Attributes:
        max_new_tokens: most tokens generated per row (>= 1).
        temperature: logits are divided by it before sampling; 0.0 means greedy (argmax).
        top_k: keep only the ``top_k`` most likely tokens (0: off).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (1.0: off); in ``(0, 1]``.
        stop_tokens: a row's generation ends after it emits one of these (the stop token is
            part of the response).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        p = self.top_p
        if not _is_real(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {p!r}")
        if not isinstance(self.stop_tokens, tuple) or not all(
            _is_int(s) and s >= 0 for s in self.stop_tokens
        ):
            raise ValueError(
                "stop_tokens must be a tuple of token ids (integers >= 0), got "
                f"{self.stop_tokens!r}"
            )

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned log-probabilities are computed at: ``temperature``,
        or 1 when greedy (what the trainer passes to ``sequence_logprobs``)."""
        return 1.0 if self.greedy else float(self.temperature)


def _scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    """``logits.float() / temperature`` (unchanged when ``temperature == 1``), checked."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        shape = tuple(logits.shape)
        raise ValueError(f"logits must be [batch, vocab] with vocab >= 1, got {shape}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    # One host sync for all checks: NaN, +inf (also a finite logit overflowing under a tiny
    # temperature), or a row with no finite entry (nothing could be drawn from it) are each
    # an upstream bug that sampling must not hide.
    bad_rows = (torch.isnan(x) | (x == math.inf)).any(dim=-1) | (x == -math.inf).all(dim=-1)
    if bool(bad_rows.any()):
        row = int(bad_rows.nonzero()[0, 0])
        raise ValueError(
            f"logits row {row} divided by temperature {temperature} has NaN or +inf entries, "
            "or no finite entry; every row needs finite logits (-inf only for tokens that can "
            "never be drawn) that stay finite when divided by the temperature"
        )
    return x


def filter_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """``scaled`` ``[B, V]`` (fp32, already divided by the temperature) with the tokens that
    top-k and then top-p remove set to ``-inf``.

    Top-k keeps the ``top_k`` largest entries of each row (0: all). Top-p then keeps, of the
    renormalized distribution that is left, the smallest set of most likely tokens whose
    probability reaches ``top_p``: a token stays when the probability of the tokens ranked
    before it is still below ``top_p``, so the most likely token always stays.
    """
    vocab = scaled.shape[-1]
    k = vocab if top_k == 0 else min(top_k, vocab)
    if k == vocab and top_p >= 1.0:
        return scaled
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)
    drop = (ranks >= k).expand_as(ordered)
    if top_p < 1.0:
        kept = ordered.masked_fill(drop, -math.inf)
        probs = torch.softmax(kept, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = drop | (before >= top_p)
    drop_in_place = torch.zeros_like(drop).scatter(-1, order, drop)
    return scaled.masked_fill(drop_in_place, -math.inf)


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """One token per row of ``logits`` ``[B, V]`` (any float dtype) and its log-probability.

    Returns ``(tokens [B] int64, logprobs [B] float32)``. Sampling: ``logits.float() /
    temperature``, top-k then top-p filtering (:func:`filter_logits`), then one draw per row
    with ``torch.multinomial(..., generator=generator)`` (the generator must live on the
    logits' device; the same generator state gives the same tokens). Greedy (argmax, no draw)
    when ``temperature == 0``.

    The log-probability is ``log_softmax(logits.float() / T)[token]`` with ``T`` the
    temperature (1 when greedy) of the *unfiltered* distribution: it is what the trainer
    computes for the same token (``hp_rl.scoring.sequence_logprobs``), which sees only the
    finished sequence and cannot know which tokens top-k/top-p removed at each step. Rollout
    and training log-probabilities then differ by rounding only, and importance ratios
    between them are meaningful.

    Raises:
        ValueError: ``logits`` is not ``[B, V]``, or a row (divided by the temperature) has
            NaN or +inf or no finite entry.
        TypeError: ``logits`` is not floating point.
    """
    scaled = _scaled_logits(logits, params.logprob_temperature)
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = torch.argmax(scaled, dim=-1)
    else:
        kept = filter_logits(scaled, params.top_k, params.top_p)
        probs = torch.softmax(kept, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.to(torch.int64), chosen.float()
