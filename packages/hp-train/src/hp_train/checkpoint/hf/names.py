"""Parameter names: hp-train's (torchtitan's) and Hugging Face's for Llama, Qwen2, Qwen3,
Qwen3-MoE and Mixtral.

The dense tensors are the same in both programs, in the same layout (the rotary convention is
the same: see :mod:`hp_train.model.llama`), so their mapping is a renaming, one to one. An MoE
block's expert stacks are stored per expert or fused (:mod:`hp_train.checkpoint.hf.moe_names`):
:func:`tensor_sources` says, for every hp-train tensor, which stored tensors hold it.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from hp_train.checkpoint.hf.moe_config import moe_family
from hp_train.checkpoint.hf.moe_names import ExpertLayout, fused_marker, moe_block_sources
from hp_train.checkpoint.hf.tensor_source import Source
from hp_train.config.schema import ModelConfig
from hp_train.model.llama import Transformer

__all__ = ["expected_tensors", "expert_layout", "hf_name", "tensor_sources"]

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    **{
        f"attn.{proj}.{kind}": f"self_attn.{proj}.{kind}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        for kind in ("weight", "bias")
    },
}


def hf_name(name: str) -> str:
    """The Hugging Face name of hp-train's parameter ``name`` (``layers.3.ffn.w1.weight`` ->
    ``model.layers.3.mlp.gate_proj.weight``).

    Raises:
        ValueError: ``name`` has no Hugging Face counterpart (MoE parameters among others).
    """
    if name in _TOP:
        return _TOP[name]
    head, _, rest = name.partition(".")
    index, _, inner = rest.partition(".")
    if head == "layers" and index.isdigit() and inner in _BLOCK:
        return f"model.layers.{index}.{_BLOCK[inner]}"
    raise ValueError(f"hp-train's parameter {name!r} has no Hugging Face Llama/Qwen counterpart")


def tensor_sources(config: ModelConfig, layout: ExpertLayout = "per_expert") -> dict[str, Source]:
    """``{hp-train name: Source}`` of every tensor of a ``config`` model (the whole model, in
    module order; a tied model has no ``lm_head.weight``), its MoE experts stored in
    ``layout`` (dense models ignore it).

    Raises:
        ConfigError: ``config`` has MoE layers no Hugging Face architecture holds
            (:func:`~hp_train.checkpoint.hf.moe_config.moe_family`).
    """
    family = moe_family(config) if config.moe is not None else None
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    moe: dict[str, Source] = {}
    if family is not None and config.moe is not None:
        for i in range(config.n_layers):
            if config.moe.is_moe_layer(i):
                for source in moe_block_sources(
                    family,
                    layout,
                    i,
                    dim=config.dim,
                    hidden=config.moe.expert_ffn_dim,
                    experts=config.moe.n_experts,
                ):
                    moe[source.own] = source
    out: dict[str, Source] = {}
    for own, shape in shapes.items():
        source = moe.pop(own) if own in moe else Source(own, shape, "whole", (hf_name(own),), shape)
        if source.shape != shape:
            raise AssertionError(f"{own}: the mapping says {source.shape}, the model {shape}")
        out[own] = source
    if moe:
        raise AssertionError(f"mapped tensors the model lacks: {sorted(moe)}")
    return out


def expected_tensors(
    config: ModelConfig, layout: ExpertLayout = "per_expert"
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{Hugging Face name: (hp-train name(s), shape)}`` of every tensor a Hugging Face
    checkpoint of a ``config`` model holds, its experts in ``layout`` (see
    :func:`tensor_sources`; a fused ``gate_up_proj`` names both hp-train stacks).

    Raises:
        ConfigError: as :func:`tensor_sources`.
    """
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for source in tensor_sources(config, layout).values():
        for name in source.names:
            if name in out:
                out[name] = (f"{out[name][0]} + {source.own}", source.stored)
            else:
                out[name] = (source.own, source.stored)
    return out


def expert_layout(config: ModelConfig, stored: Collection[str]) -> ExpertLayout:
    """The layout of the experts among the ``stored`` tensor names of a checkpoint of a
    ``config`` model: ``"fused"`` if its first MoE layer has a fused ``gate_up_proj``,
    otherwise ``"per_expert"`` (also for a dense model). Whether every other tensor is there
    is :func:`expected_tensors`' to say."""
    moe = config.moe
    if moe is None:
        return "per_expert"
    first = next((i for i in range(config.n_layers) if moe.is_moe_layer(i)), None)
    return "fused" if first is not None and fused_marker(first) in stored else "per_expert"
