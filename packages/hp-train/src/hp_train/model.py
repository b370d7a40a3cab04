"""The Llama-style decoder the training entry point trains, dense or with MoE layers.

Module names follow ``hp_dtensor.parallel.TransformerNames`` (torchtitan's), so
``transformer_tp_plan`` applies to the dense parts. An MoE feed-forward keeps its experts as
``[E, out, in]`` parameters (``w1``, ``w3``: ``[E, ffn, dim]``; ``w2``: ``[E, dim, ffn]``),
which FSDP shards like any tensor and Muon orthogonalizes per expert.

Every operation is one that ``hp_dtensor`` has a sharding rule for, so the dense model also
runs in validation mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hp_train.config import ModelConfig, MoEConfig

__all__ = ["Attention", "Block", "FeedForward", "MoEFeedForward", "RMSNorm", "Transformer"]


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


class MoEFeedForward(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts, with optional shared experts.

    Scores are a softmax over the router's logits; each token's top-k scores are renormalized
    to sum to one and weight its experts' outputs. Every token is processed (no capacity, no
    dropping). ``aux_loss`` after a forward is the Switch-style load-balancing loss
    ``E * sum_e f_e * p_e`` (``f_e``: fraction of routed slots that chose expert ``e``,
    ``p_e``: its mean score), which is 1 for perfectly balanced routing.
    """

    aux_loss: torch.Tensor | None

    def __init__(self, dim: int, moe: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        hidden = moe.expert_ffn_dim
        self.router = nn.Linear(dim, moe.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(moe.n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(moe.n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, dim, hidden))
        self.shared = (
            FeedForward(dim, hidden * moe.n_shared_experts) if moe.n_shared_experts else None
        )
        self.aux_loss = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialized like an ``nn.Linear`` of its shape."""
        for weight in (self.w1, self.w3, self.w2):
            bound = 1.0 / weight.shape[-1] ** 0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(tokens).float(), dim=-1)
        top_scores, top_experts = scores.topk(self.top_k, dim=-1)
        weights = (top_scores / top_scores.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        for e in range(self.n_experts):
            token_index, slot = (top_experts == e).nonzero(as_tuple=True)
            if token_index.numel() == 0:
                continue
            h = tokens[token_index]
            y = (F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T
            out = out.index_add(0, token_index, y * weights[token_index, slot].unsqueeze(-1))
        chosen = F.one_hot(top_experts, self.n_experts).sum(1).float()
        fraction = chosen.mean(0) / self.top_k
        self.aux_loss = self.n_experts * (fraction * scores.mean(0)).sum()
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm block: attention, then a dense or MoE feed-forward, each residual."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        moe = config.moe
        self.ffn: nn.Module = (
            MoEFeedForward(config.dim, moe)
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

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
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
        seq = ids.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.cos[:seq], self.sin[:seq]
        x: torch.Tensor = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.output(self.norm(x))
        return logits

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' load-balancing losses of the last forward (None if dense)."""
        losses = [
            m.aux_loss
            for m in self.modules()
            if isinstance(m, MoEFeedForward) and m.aux_loss is not None
        ]
        return torch.stack(losses).sum() if losses else None
