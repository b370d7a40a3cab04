"""The Llama-style decoder the training entry point trains, dense or with MoE layers.

Module names follow ``hp_dtensor.parallel.TransformerNames`` (torchtitan's), so
``transformer_tp_plan`` applies to the dense parts. An MoE feed-forward is the ``MoE`` block
of :mod:`hp_train.model.moe` (hp-dtensor's expert-parallel style shards it): its experts are
``[E, out, in]`` stacks, which FSDP shards like any tensor and Muon orthogonalizes per expert.

The options Hugging Face's Llama, Qwen2 and Qwen3 checkpoints need are all off by default (an
explicit head width, q/k/v biases, per-head q/k norms, tied embeddings, scaled rotary
frequencies). The rotary convention is theirs too: each head's halves ``(x_i, x_{i + d/2})``
are the rotated pairs ("rotate half"), so their weights map onto these modules unpermuted.

Every operation is one that ``hp_dtensor`` has a sharding rule for, so the dense model also
runs in validation mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor.parallel import CausalAttention
from hp_train.config.schema import ModelConfig, MoEConfig, RopeScaling
from hp_train.model.moe import MoE

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "RMSNorm",
    "TiedHead",
    "Transformer",
    "lm_loss",
    "moe_feed_forward",
    "rotary_inverse_frequencies",
]


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Scale back to ones (deferred initialization calls this)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def rotary_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The ``head_dim / 2`` rotary frequencies (fp32, radians per position) of ``config``:
    ``rope_theta ** (-2i / head_dim)``, then scaled as ``config.rope_scaling`` says.

    Computed in the order Hugging Face's rotary embeddings compute them, so both tables agree
    to the last bit in fp32.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    return _llama3_frequencies(inv, scaling)


def _llama3_frequencies(inv: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths (low frequencies, which saw few full turns within
    the pre-training context) are stretched by ``factor``, short ones kept, a blend between."""
    assert scaling.low_freq_factor is not None
    assert scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv
    stretched = torch.where(wavelength > context / low, inv / scaling.factor, inv)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    between = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(between, blended, stretched)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: pairs ``(x_i, x_{i + d/2})`` rotated by the position's angles."""
    half = x.shape[-1] // 2
    swapped = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped key/value heads; optionally
    biased q/k/v (and output) projections and an RMSNorm over each q and k head."""

    q_norm: RMSNorm | None
    k_norm: RMSNorm | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.kv_groups = config.n_heads // config.n_kv_heads
        q_dim = config.n_heads * config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.dim, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.dim, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # The attention itself, a module without parameters, so that context parallelism can
        # replace it (hp_dtensor.parallel.ContextParallel) and nothing else.
        self.core = CausalAttention()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]; under tensor
        # parallelism the projections are column-sharded, so this rank's heads only.
        return t.view(t.shape[0], t.shape[1], -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k = self._heads(self.q_proj(x)), self._heads(self.k_proj(x))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        v = self._heads(self.v_proj(x))
        if self.kv_groups > 1:
            b, h, s, d = k.shape
            k = k[:, :, None].expand(b, h, self.kv_groups, s, d).reshape(b, -1, s, d)
            v = v[:, :, None].expand(b, h, self.kv_groups, s, d).reshape(b, -1, s, d)
        attended = self.core(q, k, v)
        merged = attended.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        out: torch.Tensor = self.o_proj(merged)
        return out


class FeedForward(nn.Module):
    """Dense SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


def moe_feed_forward(dim: int, moe: MoEConfig) -> MoE:
    """The MoE block (:mod:`hp_train.model.moe`) for ``moe``: softmax top-k routing (the k
    weights renormalized if ``normalize_topk``), grouped
    SwiGLU experts (``experts.w1``/``w3`` ``[E, ffn, dim]``, ``experts.w2`` ``[E, dim, ffn]``),
    shared experts of ``n_shared_experts x expert_ffn_dim`` hidden units, and the
    load-balancing loss with weight ``aux_loss_weight`` entering through the block's
    backward."""
    return MoE(
        dim,
        moe.expert_ffn_dim,
        moe.n_experts,
        moe.top_k,
        normalize_weights=moe.normalize_topk,
        shared_hidden=moe.expert_ffn_dim * moe.n_shared_experts,
        aux_loss_coef=moe.aux_loss_weight,
    )


def _check_dropout(dropout: float) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, int | float):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(
            f"dropout must be a probability in [0, 1) (0: no dropout), got {dropout!r}"
        )


class Block(nn.Module):
    """Pre-norm block: attention, then a dense or MoE feed-forward, each residual.

    With ``dropout > 0`` and in training mode, each of the two outputs goes through dropout
    before it is added to the residual stream (residual dropout): every element is zeroed with
    probability ``dropout``, the others scaled by ``1 / (1 - dropout)``. The masks come from
    torch's default generator (``torch.nn.functional.dropout``), which activation
    checkpointing stashes and restores, so a recomputed forward draws the same masks; in eval
    mode, or with ``dropout == 0``, nothing is drawn and the block computes exactly what it
    computes without dropout.
    """

    def __init__(self, config: ModelConfig, index: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        _check_dropout(dropout)
        self.dropout = float(dropout)
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        moe = config.moe
        self.ffn: nn.Module = (
            moe_feed_forward(config.dim, moe)
            if moe is not None and moe.is_moe_layer(index)
            else FeedForward(config.dim, config.ffn_dim)
        )

    def _residual_dropout(self, branch: torch.Tensor) -> torch.Tensor:
        # No call at all without dropout: the graph, the numbers and the generator's state
        # stay those of a model that never had the option.
        if not (self.training and self.dropout > 0.0):
            return branch
        return F.dropout(branch, self.dropout, training=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self._residual_dropout(self.attn(self.attn_norm(x), cos, sin))
        out: torch.Tensor = h + self._residual_dropout(self.ffn(self.ffn_norm(h)))
        return out


class TiedHead(nn.Module):
    """The output head of tied embeddings: ``x @ E^T`` with ``E`` the token embedding's weight.

    It owns no parameter and reads the embedding's weight at each call, so it multiplies by
    whatever stands there then: FSDP's gathered weight during the forward, tensor parallelism's
    local rows of the vocabulary (``hp_train.parallel.parallelize`` gathers the logits).
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        # Not a submodule: the weight would be registered twice (two state-dict entries, and
        # FSDP and tensor parallelism would each see two parameters).
        self._embedding = (embedding,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._embedding[0].weight)


class Transformer(nn.Module):
    """Token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``.

    ``dropout``: residual dropout in every block (:class:`Block`), in training mode only; a
    training option rather than part of the architecture (``config``), so checkpoints and
    Hugging Face imports and exports do not carry it. Default 0: none.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | None
    output: nn.Linear | TiedHead | None

    def __init__(self, config: ModelConfig, *, dropout: float = 0.0) -> None:
        super().__init__()
        _check_dropout(dropout)
        self.config = config
        self.dropout = float(dropout)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # A dict keyed by the layer index (not a list): a pipeline stage keeps a subset of the
        # blocks under their global names, so checkpoints and plans name them the same way.
        self.layers = nn.ModuleDict(
            {str(i): Block(config, i, dropout=dropout) for i in range(config.n_layers)}
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = (
            TiedHead(self.tok_embeddings)
            if config.tie_embeddings
            else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        cos, sin = self._rotary_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # Under context parallelism (hp_train.parallel.context) a rank holds some columns of
        # each sequence: their global positions, given how many, for a forward called without
        # them (a pipeline stage's input crosses from the previous stage as hidden states only).
        self.column_positions: Callable[[int], torch.Tensor] | None = None

    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv = rotary_inverse_frequencies(self.config)
        positions = torch.arange(self.config.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, inv).repeat(1, 2)
        return angles.cos(), angles.sin()

    def reset_parameters(self) -> None:
        """Recompute the rotary tables (deferred initialization calls this)."""
        cos, sin = self._rotary_tables()
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[batch, seq]`` to logits; a pipeline stage without the embedding takes
        hidden states ``[batch, seq, dim]`` and one without the head returns them.

        ``positions``: the global position of each of the ``seq`` columns (int64 ``[seq]``),
        for a rank that holds a slice of longer sequences (context parallelism); default
        ``column_positions(seq)`` when that is set (context parallelism applied), else
        ``0 .. seq - 1``.
        """
        seq = ids.shape[1]
        if positions is None and self.column_positions is not None:
            positions = self.column_positions(seq)
        if positions is None:
            if seq > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}"
                )
            cos, sin = self.cos[:seq], self.sin[:seq]
        else:
            if positions.shape != (seq,):
                shape = tuple(positions.shape)
                raise ValueError(f"positions must be one per column, shape ({seq},), got {shape}")
            if seq and int(positions.max()) >= self.config.max_seq_len:
                raise ValueError(
                    f"position {int(positions.max())} exceeds max_seq_len {self.config.max_seq_len}"
                )
            cos, sin = self.cos[positions], self.sin[positions]
        x: torch.Tensor = ids if self.tok_embeddings is None else self.tok_embeddings(ids)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x

    def aux_loss(self) -> torch.Tensor | None:
        """The MoE layers' weighted load-balancing losses of the last forward, summed (detached:
        they already enter the gradients through the MoE blocks' backward); None if dense."""
        losses = [
            m.last_aux_loss
            for m in self.modules()
            if isinstance(m, MoE) and m.last_aux_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The language-model loss of a batch or microbatch: mean cross entropy over its tokens
    (in fp32 whatever the logits' dtype)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
