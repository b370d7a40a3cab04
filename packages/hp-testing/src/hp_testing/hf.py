"""Tiny random Hugging Face causal language models: real models nobody here wrote, for tests.

``transformers`` is imported only when a model is built (install ``hp-testing[hf]``, or list
``transformers`` in the test extra of the package whose tests use this module).

* ``"llama"``: ``LlamaForCausalLM``, grouped-query attention (4 query heads, 2 key/value
  heads) through SDPA, rotary embeddings, a SwiGLU MLP, untied embeddings.
* ``"qwen3_moe"``: ``Qwen3MoeForCausalLM``, the same attention (with per-head query/key norms)
  and a sparse MoE block (4 experts stored as stacked 3-D weights, top 2) in every layer.

Both compute their loss inside ``forward`` when given ``labels`` and return a ``ModelOutput``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

__all__ = ["KINDS", "LLAMA_CONFIG", "QWEN3_MOE_CONFIG", "VOCAB", "causal_lm", "tp_plan_styles"]

VOCAB = 64

#: Keyword arguments of ``transformers.LlamaConfig``.
LLAMA_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "attn_implementation": "sdpa",
    }
)

#: Keyword arguments of ``transformers.Qwen3MoeConfig``.
QWEN3_MOE_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        **LLAMA_CONFIG,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
)

KINDS = ("llama", "qwen3_moe")


def causal_lm(kind: str = "llama", seed: int = 0) -> nn.Module:
    """A freshly initialized model of ``kind`` (``torch.manual_seed(seed)`` first, so two calls
    with one seed give equal parameters)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "llama":
        model: nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG))
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE_CONFIG)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {KINDS}")
    return model


def tp_plan_styles(kind: str = "llama") -> dict[str, str]:
    """Megatron-style tensor parallelism in Hugging Face's module names, as ``"colwise"`` or
    ``"rowwise"`` per module pattern (the caller maps them to its styles): attention, and the
    dense MLP of ``"llama"`` (Qwen3-MoE's expert blocks are left out, replicated)."""
    layers = "model.layers.*"
    plan = {
        f"{layers}.self_attn.q_proj": "colwise",
        f"{layers}.self_attn.k_proj": "colwise",
        f"{layers}.self_attn.v_proj": "colwise",
        f"{layers}.self_attn.o_proj": "rowwise",
    }
    if kind == "llama":
        plan[f"{layers}.mlp.gate_proj"] = "colwise"
        plan[f"{layers}.mlp.up_proj"] = "colwise"
        plan[f"{layers}.mlp.down_proj"] = "rowwise"
    return plan
