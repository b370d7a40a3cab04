"""Hugging Face ``config.json`` to :class:`~hp_train.config.schema.ModelConfig` and back.

Five architectures map onto hp-train's decoder: ``LlamaForCausalLM`` (``model_type``
``llama``), ``Qwen2ForCausalLM`` (``qwen2``: q/k/v biases), ``Qwen3ForCausalLM``
(``qwen3``: per-head q/k norms, an explicit head width), and the MoE ones
``Qwen3MoeForCausalLM`` (``qwen3_moe``: Qwen3's attention, MoE feed-forwards) and
``MixtralForCausalLM`` (``mixtral``: Llama's attention, every feed-forward MoE), whose MoE keys
:mod:`hp_train.checkpoint.hf.moe_config` maps. Keys are read as ``transformers``
5 writes them (``rope_parameters``) and as older versions did (``rope_theta`` and
``rope_scaling``); a key absent from the file means what ``transformers``' config class of
that architecture defaults it to. What the decoder cannot compute (another activation, MoE
layers in a dense architecture, sliding-window attention, other rotary scalings, partial
rotary, dropout, MLP biases) is a :class:`~hp_train.config.schema.ConfigError` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hp_train.checkpoint.hf.moe_config import (
    MOE_FAMILIES,
    moe_config_keys,
    moe_family,
    read_moe_config,
)
from hp_train.config.schema import ConfigError, ModelConfig, RopeScaling

__all__ = [
    "HF_ARCHITECTURES",
    "MAX_SEQ_LEN_CAP",
    "ROPE_TYPES",
    "hf_config_dict",
    "local_folder",
    "read_hf_config",
]

#: ``architectures`` entry -> ``model_type`` of what maps onto hp-train's decoder.
HF_ARCHITECTURES: Mapping[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

#: Hugging Face rotary types hp-train computes.
ROPE_TYPES = ("default", "linear", "llama3")

#: The default ``max_seq_len`` is the checkpoint's ``max_position_embeddings`` up to this:
#: rotary tables for a 128k context cost memory a training run at shorter sequences never
#: reads (pass ``max_seq_len`` for more).
MAX_SEQ_LEN_CAP = 8192

# Keys that give a model MoE layers in some Hugging Face architecture.
_MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
# What transformers' config classes default to when config.json lacks the key.
_MAX_POSITIONS_DEFAULT = {
    "llama": 2048,
    "qwen2": 32768,
    "qwen3": 32768,
    "qwen3_moe": 32768,
    "mixtral": 4096 * 32,
}
# Families whose defaults differ from the others' (rms_norm_eps 1e-6, rope_theta 1e4).
_NORM_EPS_DEFAULT = {"mixtral": 1e-5}
_ROPE_THETA_DEFAULT = {"mixtral": 1e6}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def local_folder(path: str | Path) -> Path:
    """``path`` as an existing local folder.

    Raises:
        ConfigError: it is no folder; a name like ``org/model`` is taken for a Hugging Face
            Hub name, which hp-train does not download.
    """
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ConfigError(f"{str(path)!r} is a file; pass the checkpoint folder that holds it")
    hub_like = not folder.is_absolute() and len(folder.parts) <= 2 and "." not in folder.parts
    hint = (
        " (it looks like a Hugging Face Hub name: hp-train reads local folders only and "
        "never downloads; fetch it first, e.g. `hf download "
        f"{path} --local-dir DIR`, and pass DIR)"
        if hub_like
        else ""
    )
    raise ConfigError(f"{str(path)!r} is not an existing local folder{hint}")


def _family(raw: Mapping[str, Any], where: str) -> str:
    architectures = raw.get("architectures")
    types = sorted(set(HF_ARCHITECTURES.values()))
    supported = f"architectures {sorted(HF_ARCHITECTURES)} (model_type {types})"
    if architectures:
        if (
            not isinstance(architectures, list)
            or len(architectures) != 1
            or architectures[0] not in HF_ARCHITECTURES
        ):
            raise ConfigError(
                f"{where}: architectures {architectures!r} is not supported; hp-train loads "
                f"{supported}"
            )
        family = HF_ARCHITECTURES[architectures[0]]
        model_type = raw.get("model_type", family)
        if model_type != family:
            raise ConfigError(
                f"{where}: model_type {model_type!r} contradicts architectures "
                f"{architectures!r} (model_type {family!r})"
            )
        return family
    model_type = raw.get("model_type")
    if model_type not in HF_ARCHITECTURES.values():
        raise ConfigError(
            f"{where}: model_type {model_type!r} (and no architectures) is not supported; "
            f"hp-train loads {supported}"
        )
    return str(model_type)


def _int(raw: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None and default is not None:
        value = default
    if value is None:
        raise ConfigError(f"{where}: {key} is missing (it is required)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _float(raw: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _flag(raw: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _refuse_unsupported(raw: Mapping[str, Any], family: str, where: str, layers: int) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(
            f"{where}: hidden_act {act!r} is not supported; hp-train's feed-forward is SwiGLU "
            "('silu')"
        )
    # The MoE families' keys are read_moe_config's to check.
    for key in _MOE_KEYS if family not in MOE_FAMILIES else ():
        if raw.get(key):
            raise ConfigError(
                f"{where}: {key}={raw[key]!r} describes MoE layers, which hp-train cannot "
                "load from a Hugging Face checkpoint; only dense models are supported"
            )
    if raw.get("mlp_bias"):
        raise ConfigError(
            f"{where}: mlp_bias=true is not supported (hp-train's feed-forward has no biases)"
        )
    dropout = raw.get("attention_dropout") or 0.0
    if dropout != 0.0:
        raise ConfigError(
            f"{where}: attention_dropout={dropout!r} is not supported (hp-train's attention "
            "has no dropout); set it to 0.0"
        )
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise ConfigError(
                f"{where}: layer_types has {other}; hp-train's attention is full causal "
                "attention in every layer ('full_attention'), no sliding window"
            )
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        window_layers = raw.get("max_window_layers", 28)
        if raw.get("sliding_window") is not None and window_layers < layers:
            raise ConfigError(
                f"{where}: use_sliding_window=true gives layers {window_layers}.. a sliding "
                "window, which hp-train's attention does not have (full attention only)"
            )


def _rope(
    raw: Mapping[str, Any], where: str, max_positions: int
) -> tuple[float, RopeScaling | None]:
    block = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: {key} must be an object, got {block!r}")
    if any(isinstance(v, Mapping) for v in block.values()):
        raise ConfigError(
            f"{where}: {key} gives rotary parameters per layer type; hp-train has one rotary "
            "embedding for every layer"
        )
    theta = _float(block, "rope_theta", where, _float(raw, "rope_theta", where, 10000.0))
    partial = block.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(
            f"{where}: partial_rotary_factor={partial!r} is not supported (hp-train rotates "
            "whole heads: 1.0)"
        )
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: {key} rope_type {rope_type!r} is not supported; hp-train computes "
            f"{', '.join(repr(t) for t in ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    factor = _float(block, "factor", where, float("nan"))
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        low_freq_factor=_float(block, "low_freq_factor", where, float("nan")),
        high_freq_factor=_float(block, "high_freq_factor", where, float("nan")),
        original_max_position_embeddings=_int(
            block, "original_max_position_embeddings", where, max_positions
        ),
    )


def _attention(raw: Mapping[str, Any], family: str, where: str) -> tuple[int, bool, bool]:
    """``head_dim``, ``qkv_bias``, ``o_bias`` of a ``family`` config ``raw``."""
    dim, heads = raw["hidden_size"], raw["num_attention_heads"]
    # Only Qwen3's config class has a head_dim default of its own; the others divide.
    head_dim = _int(raw, "head_dim", where, 128 if family == "qwen3" else dim // heads)
    if family == "qwen2":
        return head_dim, True, False
    if family == "mixtral":
        # Mixtral's projections have no biases whatever the file says.
        return head_dim, False, False
    bias = _flag(raw, "attention_bias", where, False)
    return head_dim, bias, bias


def read_hf_config(path: str | Path, *, max_seq_len: int | None = None) -> ModelConfig:
    """The :class:`~hp_train.config.schema.ModelConfig` of the Hugging Face checkpoint folder
    ``path`` (its ``config.json``): ``moe`` set for Qwen3-MoE and Mixtral
    (:func:`~hp_train.checkpoint.hf.moe_config.read_moe_config`).

    Postconditions: ``Transformer(read_hf_config(path))`` has exactly the tensors of the
    checkpoint (``hp_train.checkpoint.hf.names``), computes what ``transformers`` computes with
    them, and
    has ``max_seq_len`` = the given one, or ``max_position_embeddings`` capped at
    :data:`MAX_SEQ_LEN_CAP`.

    Raises:
        ConfigError: ``path`` is no local folder (a Hub name is refused: no downloads), it has
            no ``config.json``, the architecture is not one of :data:`HF_ARCHITECTURES`
            (the supported ones are listed), a setting cannot be expressed (the key is
            named), or ``max_seq_len`` exceeds ``max_position_embeddings``.
    """
    folder = local_folder(path)
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?")
    where = str(file)
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a JSON object")
    family = _family(raw, where)
    for key in _REQUIRED:
        _int(raw, key, where)
    dim, heads = raw["hidden_size"], raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    _refuse_unsupported(raw, family, where, layers)
    max_positions = _int(raw, "max_position_embeddings", where, _MAX_POSITIONS_DEFAULT[family])
    if max_seq_len is None:
        max_seq_len = min(max_positions, MAX_SEQ_LEN_CAP)
    elif max_seq_len > max_positions:
        raise ConfigError(
            f"max_seq_len={max_seq_len} exceeds the checkpoint's max_position_embeddings="
            f"{max_positions} ({where})"
        )
    head_dim, qkv_bias, o_bias = _attention(raw, family, where)
    if family in _ROPE_THETA_DEFAULT and "rope_theta" not in raw:
        raw["rope_theta"] = _ROPE_THETA_DEFAULT[family]
    theta, scaling = _rope(raw, where, max_positions)
    moe = read_moe_config(raw, family, where, layers) if family in MOE_FAMILIES else None
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=_int(raw, "num_key_value_heads", where, heads),
        ffn_dim=raw["intermediate_size"],
        max_seq_len=max_seq_len,
        norm_eps=_float(raw, "rms_norm_eps", where, _NORM_EPS_DEFAULT.get(family, 1e-6)),
        rope_theta=theta,
        explicit_head_dim=None if head_dim * heads == dim else head_dim,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tie_embeddings=_flag(raw, "tie_word_embeddings", where, False),
        rope_scaling=scaling,
        moe=moe,
    )


def _family_of(config: ModelConfig) -> str:
    if config.moe is not None:
        return moe_family(config)
    if config.qk_norm:
        family = "qwen3"
    elif config.qkv_bias and not config.o_bias:
        family = "qwen2"
    else:
        family = "llama"
    if family != "qwen2" and config.qkv_bias != config.o_bias:
        raise ConfigError(
            f"qkv_bias={config.qkv_bias} with o_bias={config.o_bias}: "
            f"{'Qwen3' if family == 'qwen3' else 'Llama'}'s attention_bias gives the four "
            "projections biases or none"
        )
    return family


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``config`` for ``transformers``: ``Qwen3ForCausalLM`` with q/k
    norms, ``Qwen2ForCausalLM`` with q/k/v biases only, ``LlamaForCausalLM`` otherwise; with
    MoE layers ``Qwen3MoeForCausalLM`` (q/k norms) or ``MixtralForCausalLM``
    (:func:`~hp_train.checkpoint.hf.moe_config.moe_family`); weights of ``dtype``.
    ``max_position_embeddings`` is ``max_seq_len``.

    Postcondition: ``read_hf_config`` of a folder with it gives ``config`` back (for Mixtral,
    which has no dense layer, with ``ffn_dim`` = ``moe.expert_ffn_dim``).

    Raises:
        ConfigError: biases, or MoE layers, no architecture has (the reason is named).
    """
    family = _family_of(config)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None:
        rope.update({k: v for k, v in vars(scaling).items() if v is not None})
    architecture = next(a for a, f in HF_ARCHITECTURES.items() if f == family)
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if family not in ("qwen2", "mixtral"):
        out["attention_bias"] = config.qkv_bias
    if family in MOE_FAMILIES:
        out.update(moe_config_keys(config, family))
    elif family == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["layer_types"] = ["full_attention"] * config.n_layers
    return out
