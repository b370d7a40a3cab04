"""A small Llama-style model for tests and benchmarks of the parallel packages.

Embedding, RMSNorm, attention with rotary embeddings and causal SDPA, SwiGLU MLP, LM head. The
code derives every size it needs from tensor shapes and uses ``-1`` where a size depends on
how the tensor is sharded, so the same model runs unchanged on whole tensors, on DTensors and
on tensor-parallel local shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "Block", "FeedForward", "Llama", "LlamaConfig", "RMSNorm"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the model.

    Attributes:
        vocab_size: tokens.
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads (``dim`` must divide by it).
        ffn_dim: hidden width of the SwiGLU MLP.
        max_seq_len: longest sequence (rotary tables).
        norm_eps: RMSNorm epsilon.
        dropout: probability of the residual dropouts after attention and MLP.
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 64
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Scale 1."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = FeedForward(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.ffn_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x + self.attn_dropout(self.attn(self.attn_norm(x), cos, sin))
        out: torch.Tensor = h + self.ffn_dropout(self.ffn(self.ffn_norm(h)))
        return out


class Llama(nn.Module):
    """Token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = self.rotary_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the model's own state, the rotary tables (sub-modules reset themselves);
        deferred initialization calls it."""
        cos, sin = self.rotary_tables()
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of the rotary angles, ``[max_seq_len, head_dim]``."""
        dim = self.config.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(self.config.max_seq_len, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    cos: torch.Tensor
    sin: torch.Tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.tok_embeddings(ids)
        seq = ids.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.output(self.norm(x))
        return logits
