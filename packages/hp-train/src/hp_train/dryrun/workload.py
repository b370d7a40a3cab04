"""What one training step asks of a rank: its shape (batch, precision, schedule options) and
the per-layer FLOPs and saved activations of the model.

FLOPs model (forward, per token, per rank; a multiply-add is 2 FLOPs; backward is twice the
forward; recomputation adds one more forward of the blocks):

* attention projections ``2 * (2 * dim * q_dim + 2 * dim * kv_dim) / tp`` (``q_dim`` is
  ``n_heads * head_dim``, ``dim`` unless the head width is explicit); scores and weighted
  values ``2 * seq * q_dim / tp`` (``4 * seq * q_dim`` for all pairs, halved by the causal
  mask);
* dense SwiGLU ``6 * dim * ffn / tp``; MoE: router ``2 * dim * E``, ``top_k`` routed experts
  and the shared ones, ``6 * dim * expert_ffn`` each, not divided by ``tp``: the trainer's plan
  keeps MoE feed-forwards whole, so every tensor-parallel rank computes them for all tokens;
* output head ``2 * dim * vocab / tp``; the embedding lookup is free.

Activation model (elements saved for backward per token; the tensors autograd keeps for this
model's modules, with flash attention keeping no ``seq x seq`` scores):

* each RMSNorm: its input, the normalized input and its output: ``3 * dim`` (two per block);
* attention: q, k and v (expanded to all heads), the attention output and its merged copy
  (the o_proj input): ``5 * q_dim / tp``, plus ``n_heads / tp`` log-sum-exp values (with
  ``flash_attention=False``, the ``n_heads / tp * seq`` attention probabilities instead);
  per-head q/k norms (``qk_norm``) like RMSNorms: ``3 * (q_dim + kv_dim) / tp``;
* dense SwiGLU: w1's output, its SiLU, w3's output and their product: ``4 * ffn / tp``;
* MoE (whole on every tensor-parallel rank, as the trainer keeps it): router scores ``E``
  (fp32) and, per routed slot (``top_k`` per token), the gathered input ``dim``,
  ``4 * expert_ffn`` and the expert output ``dim``; shared experts like a dense SwiGLU of width
  ``n_shared * expert_ffn``, not divided by ``tp`` either;
* head: final norm ``3 * dim`` and the logits plus their log-softmax, ``2 * vocab`` in fp32
  (the loss's gathered logits are whole on every tensor-parallel rank).

With ``recompute`` each block keeps only its input (``dim`` per token); one block's full
activations exist again while it is recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_train.config import ModelConfig
from hp_train.dryrun.presets import DryRunError

__all__ = [
    "BF16_MIXED",
    "FP32",
    "Precision",
    "StepShape",
    "block_activation_bytes",
    "block_forward_flops",
    "head_activation_bytes",
    "head_forward_flops",
]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of data.

    Attributes:
        param: sharded parameters (FSDP's storage, the master weights).
        compute: unsharded parameters (the all-gather), activations and unsharded gradients
            (FSDP's ``param_dtype``).
        reduce: gradient reduction (reduce-scatter input, HSDP all-reduce) and the sharded
            gradients (FSDP's ``reduce_dtype``).
        optimizer: optimizer state (Muon momentum, AdamW moments).
    """

    param: int = 4
    compute: int = 4
    reduce: int = 4
    optimizer: int = 4

    def __post_init__(self) -> None:
        for name in ("param", "compute", "reduce", "optimizer"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise DryRunError(f"precision.{name} must be 1, 2, 4 or 8 bytes")


FP32 = Precision()
"""Everything in fp32 (the CPU runs)."""

BF16_MIXED = Precision(param=4, compute=2, reduce=4, optimizer=4)
"""fp32 master weights, optimizer state and gradient reduction; bf16 compute and all-gather."""


@dataclass(frozen=True)
class StepShape:
    """The shape and options of one optimizer step.

    Attributes:
        global_batch: sequences per step over all data-parallel ranks.
        seq_len: tokens per sequence.
        microbatches: sequential microbatches per data-parallel rank (gradient accumulation;
            pipeline microbatches with ``pp > 1``); each runs FSDP's gathers and reductions.
        recompute: activation checkpointing of every block.
        optimizer: ``"muon"`` (Muon on matrices, AdamW on the rest) or ``"adamw"``.
        precision: bytes per element.
        prefetch: FSDP prefetches the next group (accelerators: yes; hp_fsdp on CPU: no).
        flash_attention: attention keeps no ``seq x seq`` scores.
        muon_bucket_mb: ``hp_muon.Muon``'s ``bucket_cap_mb`` (bf16 MiB per exchange).
    """

    global_batch: int
    seq_len: int
    microbatches: int = 1
    recompute: bool = False
    optimizer: str = "muon"
    precision: Precision = BF16_MIXED
    prefetch: bool = True
    flash_attention: bool = True
    muon_bucket_mb: float = 32.0

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DryRunError(f"{name} must be a positive integer, got {value!r}")
        if self.optimizer not in ("muon", "adamw"):
            raise DryRunError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if not self.muon_bucket_mb > 0:
            raise DryRunError(f"muon_bucket_mb must be > 0, got {self.muon_bucket_mb}")

    def microbatch_size(self, dp: int) -> int:
        """Sequences per microbatch on one data-parallel rank.

        Raises:
            DryRunError: the global batch does not split evenly over ``dp`` ranks and the
                microbatches.
        """
        if self.global_batch % dp:
            raise DryRunError(
                f"global_batch={self.global_batch} is not divisible by the data-parallel degree "
                f"dp_replicate x dp_shard = {dp}"
            )
        local = self.global_batch // dp
        if local % self.microbatches:
            raise DryRunError(
                f"the {local} sequences per data-parallel rank do not split into "
                f"microbatches={self.microbatches}; choose a divisor of {local}"
            )
        return local // self.microbatches


def _kv_dim(model: ModelConfig) -> int:
    return model.n_kv_heads * model.head_dim


def _q_dim(model: ModelConfig) -> int:
    return model.n_heads * model.head_dim


def block_forward_flops(model: ModelConfig, index: int, tp: int, seq_len: int) -> float:
    """Forward FLOPs per token of block ``index`` on one of ``tp`` tensor-parallel ranks."""
    d, q = model.dim, _q_dim(model)
    attn = 2 * (2 * d * q + 2 * d * _kv_dim(model)) / tp + 2 * seq_len * q / tp
    moe = model.moe
    if moe is not None and moe.is_moe_layer(index):
        experts = moe.top_k + moe.n_shared_experts
        ffn: float = 2 * d * moe.n_experts + experts * 6 * d * moe.expert_ffn_dim
    else:
        ffn = 6 * d * model.ffn_dim / tp
    return attn + ffn


def head_forward_flops(model: ModelConfig, tp: int) -> float:
    """Forward FLOPs per token of the output head on one of ``tp`` ranks."""
    return 2 * model.dim * model.vocab_size / tp


def block_activation_bytes(
    model: ModelConfig,
    index: int,
    tokens: int,
    seq_len: int,
    tp: int,
    precision: Precision,
    *,
    flash_attention: bool = True,
) -> int:
    """Bytes block ``index`` saves for backward for ``tokens`` tokens (see the module doc)."""
    d = model.dim
    norms = 6 * d
    scores = model.n_heads / tp * (1 if flash_attention else seq_len)
    attn = 5 * _q_dim(model) / tp
    if model.qk_norm:
        attn += 3 * (_q_dim(model) + _kv_dim(model)) / tp
    moe = model.moe
    fp32 = 0.0
    if moe is not None and moe.is_moe_layer(index):
        fe = moe.expert_ffn_dim
        ffn: float = moe.top_k * (2 * d + 4 * fe) + 4 * moe.n_shared_experts * fe
        fp32 += moe.n_experts
    else:
        ffn = 4 * model.ffn_dim / tp
    fp32 += scores
    return int(tokens * ((norms + attn + ffn) * precision.compute + fp32 * 4))


def head_activation_bytes(model: ModelConfig, tokens: int, precision: Precision) -> int:
    """Bytes the final norm and the output head save for ``tokens`` tokens."""
    return int(tokens * (3 * model.dim * precision.compute + 2 * model.vocab_size * 4))
