"""The Llama-style decoder the training entry point trains, dense or with MoE layers.

Module names follow ``hp_dtensor.parallel.TransformerNames`` (torchtitan's), so
``transformer_tp_plan`` applies to the dense parts. An MoE feed-forward is hp-dtensor's
``MoE`` block: its experts are ``[E, out, in]`` stacks, which FSDP shards like any tensor and
Muon orthogonalizes per expert.

Every operation is one that ``hp_dtensor`` has a sharding rule for, so the dense model also
runs in validation mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor.parallel import MoE
from hp_train.config import ModelConfig, MoEConfig

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "lm_loss",
    "moe_feed_forward",
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: pairs ``(x_i, x_{i + d/2})`` rotated by the position's angles."""
    half = x.shape[-1] // 2
    swapped = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped key/value heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.kv_groups = config.n_heads // config.n_kv_heads
        kv_dim = config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]; under tensor
        # parallelism the projections are column-sharded, so this rank's heads only.
        return t.view(t.shape[0], t.shape[1], -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = _rotate(self._heads(self.q_proj(x)), cos, sin)
        k = _rotate(self._heads(self.k_proj(x)), cos, sin)
        v = self._heads(self.v_proj(x))
        if self.kv_groups > 1:
            b, h, s, d = k.shape
            k = k[:, :, None].expand(b, h, self.kv_groups, s, d).reshape(b, -1, s, d)
            v = v[:, :, None].expand(b, h, self.kv_groups, s, d).reshape(b, -1, s, d)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
    """hp-dtensor's MoE block for ``moe``: softmax top-k routing, grouped SwiGLU experts
    (``experts.w1``/``w3`` ``[E, ffn, dim]``, ``experts.w2`` ``[E, dim, ffn]``), shared experts
    of ``n_shared_experts x expert_ffn_dim`` hidden units, and the load-balancing loss with
    weight ``aux_loss_weight`` entering through the block's backward."""
    return MoE(
        dim,
        moe.expert_ffn_dim,
        moe.n_experts,
        moe.top_k,
        shared_hidden=moe.expert_ffn_dim * moe.n_shared_experts,
        aux_loss_coef=moe.aux_loss_weight,
    )


class Block(nn.Module):
    """Pre-norm block: attention, then a dense or MoE feed-forward, each residual."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        moe = config.moe
        self.ffn: nn.Module = (
            moe_feed_forward(config.dim, moe)
            if moe is not None and moe.is_moe_layer(index)
            else FeedForward(config.dim, config.ffn_dim)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = h + self.ffn(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """Token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``."""

    cos: torch.Tensor
    sin: torch.Tensor
    tok_embeddings: nn.Embedding | None
    norm: RMSNorm | None
    output: nn.Linear | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # A dict keyed by the layer index (not a list): a pipeline stage keeps a subset of the
        # blocks under their global names, so checkpoints and plans name them the same way.
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = self._rotary_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        inv = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float32), inv)
        angles = angles.repeat(1, 2)
        return angles.cos(), angles.sin()

    def reset_parameters(self) -> None:
        """Recompute the rotary tables (deferred initialization calls this)."""
        cos, sin = self._rotary_tables()
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, seq]`` to logits; a pipeline stage without the embedding takes
        hidden states ``[batch, seq, dim]`` and one without the head returns them."""
        seq = ids.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.cos[:seq], self.sin[:seq]
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
