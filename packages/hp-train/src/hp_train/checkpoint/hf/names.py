"""Parameter names: hp-train's (torchtitan's) and Hugging Face's for Llama, Qwen2 and Qwen3.

The two models have the same tensors, in the same layout (the rotary convention is the same:
see :mod:`hp_train.model.llama`), so the mapping is a renaming, one to one.
"""

from __future__ import annotations

import torch

from hp_train.config.schema import ConfigError, ModelConfig
from hp_train.model.llama import Transformer

__all__ = ["expected_tensors", "hf_name"]

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


def expected_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{Hugging Face name: (hp-train name, shape)}`` of every tensor of a ``config`` model
    (the whole model, in module order; a tied model has no ``lm_head.weight``).

    Raises:
        ConfigError: ``config`` has MoE layers (Hugging Face's MoE architectures are not
            mapped here).
    """
    if config.moe is not None:
        raise ConfigError(
            "the model has MoE layers (moe is set); hp-train maps only dense Llama, Qwen2 and "
            "Qwen3 models to Hugging Face names, no MoE architecture"
        )
    with torch.device("meta"):
        model = Transformer(config)
    return {hf_name(k): (k, tuple(v.shape)) for k, v in model.state_dict().items()}
