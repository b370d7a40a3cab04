"""Training FLOPs per token of a :class:`~hp_train.config.schema.ModelConfig`, and MFU.

What is counted (a multiply-add is 2 FLOPs), per token of a sequence of ``seq_len``:

* attention, in every block: the q, k and v projections (``dim -> n_heads * head_dim``,
  ``dim -> 2 * n_kv_heads * head_dim``), the output projection, and the two products of
  attention at the run's sequence length -- scores ``q k^T`` and the weighted sum of values,
  each ``2 * seq_len * n_heads * head_dim``. The causal mask is not subtracted (the
  convention of PaLM's and Megatron's MFU; FlashAttention-style kernels that skip the masked
  half do less work than counted);
* the feed-forward: a dense SwiGLU's three matrices (``3 * 2 * dim * ffn_dim``), or in an
  MoE block the router (``2 * dim * n_experts``), the ``top_k`` routed experts' SwiGLUs
  and the shared experts' (``3 * 2 * dim * expert_ffn_dim`` each);
* the output head (``2 * dim * vocab_size``), tied to the embedding or not.

Forward plus backward is 3x the forward: the backward of a product computes two products
of the same size (the gradients of its input and of its weight).

Not counted: the embedding lookup (no multiply), norms, rotary embeddings, softmax, SwiGLU's
activation and elementwise product, residual additions, biases, the loss, MoE routing's
top-k and load-balancing loss, and the optimizer step (Muon's Newton-Schulz iterations
included). Recomputation under activation checkpointing is not counted either: MFU counts
the model's FLOPs, not the hardware's.
"""

from __future__ import annotations

import math

from hp_train.config.schema import ModelConfig

__all__ = ["forward_flops_per_token", "mfu", "training_flops_per_token"]


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")


def _attention_flops(config: ModelConfig, seq_len: int) -> int:
    q_dim = config.n_heads * config.head_dim
    kv_dim = config.n_kv_heads * config.head_dim
    projections = 2 * config.dim * (q_dim + 2 * kv_dim) + 2 * q_dim * config.dim
    products = 2 * (2 * seq_len * q_dim)  # scores, then the weighted sum of values
    return projections + products


def _feed_forward_flops(config: ModelConfig, layer: int) -> int:
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer):
        return 3 * 2 * config.dim * config.ffn_dim
    router = 2 * config.dim * moe.n_experts
    experts = (moe.top_k + moe.n_shared_experts) * 3 * 2 * config.dim * moe.expert_ffn_dim
    return router + experts


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """The forward FLOPs of one token of a ``seq_len``-token sequence through the whole model
    (module docstring: what is counted).

    Raises:
        ValueError: ``seq_len`` not a positive int.
    """
    _check_seq_len(seq_len)
    blocks = sum(
        _attention_flops(config, seq_len) + _feed_forward_flops(config, layer)
        for layer in range(config.n_layers)
    )
    return blocks + 2 * config.dim * config.vocab_size


def training_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Forward and backward FLOPs of one training token: 3 x :func:`forward_flops_per_token`.

    Raises:
        ValueError: ``seq_len`` not a positive int.
    """
    return 3 * forward_flops_per_token(config, seq_len)


def mfu(
    flops_per_token: int, tokens: int, seconds: float, ranks: int, peak_flops_per_rank: float | None
) -> float | None:
    """Model FLOPs utilization of a step: ``flops_per_token * tokens / seconds / ranks``
    (the FLOP/s each rank achieved, on average) over ``peak_flops_per_rank``; None without a
    peak (unknown hardware) or with a step time that is not positive and finite.

    Raises:
        ValueError: ``ranks`` < 1, or a peak that is not positive.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if peak_flops_per_rank is None:
        return None
    if not peak_flops_per_rank > 0:
        raise ValueError(f"the peak FLOP/s per rank must be positive, got {peak_flops_per_rank}")
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    return flops_per_token * tokens / seconds / ranks / peak_flops_per_rank
