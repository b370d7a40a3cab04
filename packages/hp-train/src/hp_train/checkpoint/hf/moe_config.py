"""The MoE part of a Hugging Face ``config.json`` (Qwen3-MoE, Mixtral) to
:class:`~hp_train.config.schema.MoEConfig` and back.

Both architectures route each token with a softmax over the router's logits and send it to
the top ``num_experts_per_tok`` experts, weighted by their probabilities: Mixtral always
renormalizes those weights to sum to one, Qwen3-MoE when ``norm_topk_prob`` is true
(``MoEConfig.normalize_topk``). Every Mixtral layer is MoE; a Qwen3-MoE layer ``i`` is MoE when
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``, otherwise a
dense SwiGLU of ``intermediate_size``: hp-train's ``moe_every`` expresses exactly the patterns
``(i + 1) % every == 0``, so other ones are refused.

The load-balancing loss: ``transformers`` adds ``router_aux_loss_coef`` times its loss only
when ``output_router_logits`` is true, so that is when ``aux_loss_weight`` takes the
coefficient (otherwise 0). The two losses differ in form: ``transformers`` pools the
assignment fractions and mean probabilities over all layers before multiplying, and counts
a token's k assignments (fractions summing to k); hp-train sums one Switch-style loss per MoE
layer with fractions over the ``T * k`` assignments (summing to 1). The coefficient is carried
over as it is, not converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig

__all__ = ["MOE_FAMILIES", "moe_config_keys", "moe_family", "read_moe_config", "refuse_moe_keys"]

#: ``model_type`` of the MoE architectures mapped here.
MOE_FAMILIES = ("qwen3_moe", "mixtral")

# What transformers' config classes default to when config.json lacks the key.
_QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
}
_MIXTRAL_DEFAULTS: dict[str, Any] = {"num_local_experts": 8, "num_experts_per_tok": 2}
_AUX_COEF_DEFAULT = 0.001


def _int(raw: Mapping[str, Any], key: str, where: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _bool(raw: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def refuse_moe_keys(raw: Mapping[str, Any], family: str, where: str) -> None:
    """Raise a :class:`ConfigError` naming the first key of ``raw`` (a ``family`` config)
    that hp-train cannot express: a sliding attention window, Mixtral's router jitter."""
    if family == "mixtral":
        if raw.get("sliding_window") is not None:
            raise ConfigError(
                f"{where}: sliding_window={raw['sliding_window']!r} gives Mixtral's attention a "
                "sliding window, which hp-train's attention does not have (full attention "
                "only: null)"
            )
        jitter = raw.get("router_jitter_noise") or 0.0
        if jitter != 0.0:
            raise ConfigError(
                f"{where}: router_jitter_noise={jitter!r} multiplies the router's input by "
                "noise in training, which hp-train's router does not do; set it to 0.0"
            )
    elif raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        raise ConfigError(
            f"{where}: use_sliding_window=true gives Qwen3-MoE's attention a sliding window "
            f"of {raw['sliding_window']!r}, which hp-train's attention does not have (full "
            "attention only)"
        )


def _qwen3_experts(raw: Mapping[str, Any], where: str) -> int:
    # transformers' Qwen3MoeConfig names it num_experts; save_pretrained writes the attribute
    # under num_local_experts, which it maps back.
    given = {k: raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"{where}: {given} disagree on the number of experts")
    key = next(iter(given), "num_experts")
    experts = _int(raw, key, where, _QWEN3_MOE_DEFAULTS["num_experts"])
    if experts <= 0:
        raise ConfigError(
            f"{where}: {key}={experts} leaves no MoE layer; a dense model is a Qwen3 "
            "checkpoint (Qwen3ForCausalLM), not a Qwen3-MoE one"
        )
    return experts


def _every(raw: Mapping[str, Any], where: str, layers: int) -> int:
    """``moe_every`` of Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step = _int(raw, "decoder_sparse_step", where, 1)
    if step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step must be >= 1, got {step}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise ConfigError(
            f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}"
        )
    moe = [i for i in range(layers) if (i + 1) % step == 0 and i not in dense]
    if not moe:
        raise ConfigError(
            f"{where}: decoder_sparse_step={step} with mlp_only_layers={dense} leaves no MoE "
            f"layer among the {layers}"
        )
    every = moe[0] + 1
    if moe != [i for i in range(layers) if (i + 1) % every == 0]:
        raise ConfigError(
            f"{where}: mlp_only_layers={dense} with decoder_sparse_step={step} makes layers "
            f"{moe} MoE, which hp-train's moe_every (every N-th layer: (i + 1) % N == 0) cannot "
            "express"
        )
    return every


def _aux_weight(raw: Mapping[str, Any], where: str) -> float:
    coef = raw.get("router_aux_loss_coef", _AUX_COEF_DEFAULT)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or coef < 0:
        raise ConfigError(f"{where}: router_aux_loss_coef must be a number >= 0, got {coef!r}")
    return float(coef) if _bool(raw, "output_router_logits", where, False) else 0.0


def read_moe_config(raw: Mapping[str, Any], family: str, where: str, layers: int) -> MoEConfig:
    """The MoE layers of the ``family`` (``"qwen3_moe"`` or ``"mixtral"``) config ``raw`` of
    ``layers`` layers.

    Postcondition: hp-train's layers with an MoE feed-forward (``is_moe_layer``) are those of
    ``transformers``' model, with its experts, top-k, expert width and weight normalization.

    Raises:
        ConfigError: a key hp-train cannot express (named), or a value of the wrong type.
    """
    refuse_moe_keys(raw, family, where)
    if family == "mixtral":
        experts = _int(raw, "num_local_experts", where, _MIXTRAL_DEFAULTS["num_local_experts"])
        top_k = _int(raw, "num_experts_per_tok", where, _MIXTRAL_DEFAULTS["num_experts_per_tok"])
        hidden, every, normalize = _int(raw, "intermediate_size", where, 0), 1, True
    elif family == "qwen3_moe":
        experts = _qwen3_experts(raw, where)
        top_k = _int(raw, "num_experts_per_tok", where, _QWEN3_MOE_DEFAULTS["num_experts_per_tok"])
        hidden = _int(
            raw, "moe_intermediate_size", where, _QWEN3_MOE_DEFAULTS["moe_intermediate_size"]
        )
        every = _every(raw, where, layers)
        normalize = _bool(raw, "norm_topk_prob", where, _QWEN3_MOE_DEFAULTS["norm_topk_prob"])
    else:
        raise ValueError(f"no MoE architecture {family!r}; known: {MOE_FAMILIES}")
    try:
        return MoEConfig(
            n_experts=experts,
            top_k=top_k,
            expert_ffn_dim=hidden,
            every=every,
            n_shared_experts=0,
            aux_loss_weight=_aux_weight(raw, where),
            normalize_topk=normalize,
        )
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def moe_family(config: ModelConfig) -> str:
    """The architecture that holds the MoE model ``config``: ``"qwen3_moe"`` with per-head q/k
    norms, ``"mixtral"`` without.

    Raises:
        ConfigError: ``config`` is dense, or has what neither architecture has (shared
            experts; without q/k norms: biases, unnormalized top-k weights, dense layers).
    """
    moe = config.moe
    if moe is None:
        raise ConfigError("the model has no MoE layers (moe is None)")
    if moe.n_shared_experts:
        raise ConfigError(
            f"moe.n_shared_experts={moe.n_shared_experts}: neither Qwen3-MoE nor Mixtral has "
            "shared experts, so no Hugging Face architecture holds this model"
        )
    if config.qk_norm:
        if config.qkv_bias != config.o_bias:
            raise ConfigError(
                f"qkv_bias={config.qkv_bias} with o_bias={config.o_bias}: Qwen3-MoE's "
                "attention_bias gives the four projections biases or none"
            )
        return "qwen3_moe"
    why = [
        reason
        for reason, present in (
            ("attention biases (qkv_bias/o_bias)", config.qkv_bias or config.o_bias),
            ("top-k weights not renormalized (normalize_topk=false)", not moe.normalize_topk),
            (f"dense layers (moe.every={moe.every})", moe.every != 1),
        )
        if present
    ]
    if why:
        raise ConfigError(
            f"the model's MoE layers fit no Hugging Face architecture: without q/k norms it "
            f"would be Mixtral, which has none of {'; '.join(why)} (Qwen3-MoE, with q/k "
            "norms, has all of them)"
        )
    return "mixtral"


def moe_config_keys(config: ModelConfig, family: str) -> dict[str, Any]:
    """The MoE keys of ``config.json`` for ``config`` as a ``family`` model (as
    :func:`moe_family` chose it): experts, top-k, widths, sparsity pattern, normalization and
    the auxiliary loss (:func:`read_moe_config` of them gives ``config.moe`` back)."""
    moe = config.moe
    if moe is None:
        raise ConfigError("the model has no MoE layers (moe is None)")
    aux = {
        "output_router_logits": moe.aux_loss_weight > 0.0,
        "router_aux_loss_coef": moe.aux_loss_weight,
    }
    if family == "mixtral":
        return {
            "num_local_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k,
            "intermediate_size": moe.expert_ffn_dim,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            **aux,
        }
    return {
        "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_ffn_dim,
        "decoder_sparse_step": moe.every,
        "mlp_only_layers": [],
        "norm_topk_prob": moe.normalize_topk,
        "use_sliding_window": False,
        "sliding_window": None,
        **aux,
    }
