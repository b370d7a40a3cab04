"""Hugging Face models as the pricing sees them, without hp-train: a test-local
:class:`hp_planner.price.PricedModel` of ``LlamaForCausalLM`` (dense, grouped-query attention)
and ``Qwen3MoeForCausalLM`` (every block MoE, q/k norms), built from tiny random configs on
``meta``.

What a user with their own model writes: the transformer shape read off the config, the stage
cut (blocks split as evenly as they go, the embedding on the first stage, the norm and head on
the last, blocks keeping their global names), Megatron's tensor-parallel plan under Hugging
Face's names (MoE feed-forwards kept whole) and one ``fully_shard`` unit per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor.parallel import ParallelStyle, TransformerNames, transformer_tp_plan
from hp_planner import JobDims, ModelParallelism, TrainingPolicy
from hp_planner.price import MoEDims, PricingError, StepShape, TransformerDims

transformers = pytest.importorskip("transformers")

HF_NAMES = TransformerNames(
    embedding="model.embed_tokens",
    blocks="model.layers.*",
    attention="self_attn",
    mlp="mlp",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
    norms=("input_layernorm", "post_attention_layernorm"),
    dropouts=(),
    final_norm="model.norm",
    head="lm_head",
)


def llama_config(**sizes: Any) -> Any:
    """A tiny random ``LlamaConfig`` (untied embeddings; ``sizes`` override)."""
    base: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return transformers.LlamaConfig(**(base | sizes))


def qwen3_moe_config(**sizes: Any) -> Any:
    """A tiny random ``Qwen3MoeConfig``: every block MoE, 4 experts, top 2."""
    base: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return transformers.Qwen3MoeConfig(**(base | sizes))


def _shape(config: Any) -> TransformerDims:
    moe = None
    if getattr(config, "num_experts", 0):
        moe = MoEDims(
            n_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            expert_ffn_dim=config.moe_intermediate_size,
            every=config.decoder_sparse_step,
        )
    heads = config.num_attention_heads
    return TransformerDims(
        vocab_size=config.vocab_size,
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn_dim=config.intermediate_size,
        qk_norm=config.model_type == "qwen3_moe",
        moe=moe,
    )


@dataclass(frozen=True, eq=False)
class HFPriced:
    """A Hugging Face causal LM to price (module doc). Compared by identity."""

    config: Any

    @property
    def shape(self) -> TransformerDims:
        return _shape(self.config)

    @property
    def blocks(self) -> str:
        return "model.layers"

    @property
    def embedding(self) -> str:
        return "model.embed_tokens"

    @property
    def head(self) -> str:
        return "lm_head"

    def _build(self) -> Any:
        with torch.device("meta"):
            if self.config.model_type == "qwen3_moe":
                return transformers.Qwen3MoeForCausalLM(self.config)
            return transformers.LlamaForCausalLM(self.config)

    def stage_boundaries(self, pp: int) -> tuple[int, ...]:
        n = self.config.num_hidden_layers
        return tuple(k * n // pp for k in range(pp + 1))

    def stage_models(self, pp: int) -> Sequence[nn.Module]:
        bounds = self.stage_boundaries(pp)
        stages: list[nn.Module] = []
        for k in range(pp):
            model = self._build()
            # Blocks keep their global names (``model.layers.2`` on the second of two stages of
            # four blocks), as the pricing's block indices are the model's.
            keep = range(bounds[k], bounds[k + 1])
            model.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in keep})
            if k:
                model.model.embed_tokens = None
            if k < pp - 1:
                model.model.norm = None
                model.lm_head = None
            stages.append(model)
        return stages

    def parallelism(self, dims: JobDims) -> ModelParallelism:
        plan: dict[str, ParallelStyle] = transformer_tp_plan(names=HF_NAMES)
        if self.shape.moe is not None:
            plan = {k: v for k, v in plan.items() if ".mlp." not in k}
        return ModelParallelism.of(plan, fsdp_units=("model.layers.*",))

    def policy(self) -> TrainingPolicy:
        return TrainingPolicy(optimizer="muon", adamw_patterns=("*.mlp.gate.weight",))

    def check_fits(self, dims: JobDims) -> None:
        shape = self.shape
        for name in ("n_heads", "n_kv_heads", "vocab_size"):
            if getattr(shape, name) % dims.tp:
                raise PricingError(f"tp={dims.tp} must divide {name}={getattr(shape, name)}")
        if shape.moe is None and shape.ffn_dim % dims.tp:
            raise PricingError(f"tp={dims.tp} must divide ffn_dim={shape.ffn_dim}")
        if dims.pp > shape.n_layers:
            raise PricingError(f"pp={dims.pp} exceeds n_layers={shape.n_layers}")
        if dims.ep > 1 or dims.cp > 1:
            raise PricingError("this test model plans neither expert nor context parallelism")

    def check_accepts(self, dims: JobDims, step: StepShape) -> None:
        del dims, step
