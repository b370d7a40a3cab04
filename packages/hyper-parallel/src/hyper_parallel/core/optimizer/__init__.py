"""``hyper_parallel.core.optimizer``: upstream's ``get_hyper_optimizer`` (Muon on some parameter
groups chained with AdamW on the others) on ``hp_muon.Muon``, ``torch.optim.AdamW`` and
``hp_muon.ChainedOptimizer``.

Upstream's Muon is mapped to hp-muon's with upstream's numerics: its 5 Newton-Schulz
coefficient triples (hp-muon's ``"you_5step"`` preset), its learning-rate adjustment
``lr * matched_adamw_rms * sqrt(max(rows, cols))`` with ``matched_adamw_rms = 0.2`` (hp-muon's
``"match_rms_adamw"``), momentum with Nesterov. Upstream sums the momentum where hp-muon (as
``torch.optim.Muon``) averages it; the update is the same up to Newton-Schulz's normalization
epsilon (1e-7), since Newton-Schulz divides by the norm first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hp_muon import ChainedOptimizer, Muon
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["get_hyper_optimizer"]

#: Upstream's Newton-Schulz coefficients (5 triples, one per step) as an hp-muon preset.
UPSTREAM_NS_COEFFICIENTS = "you_5step"
#: The only ``matched_adamw_rms`` hp-muon's ``"match_rms_adamw"`` adjustment implements.
MATCHED_ADAMW_RMS = 0.2

_MUON_UPSTREAM = ("lr", "weight_decay", "matched_adamw_rms", "momentum", "nesterov", "ns_steps")
_MUON_NATIVE = (
    "ns_coefficients",
    "eps",
    "adjust_lr_fn",
    "row_blocks",
    "process_group",
    "replicate_group",
    "bucket_cap_mb",
    "fuse_shapes",
    "ns_dtype",
)
_MUON_INSTEAD = {
    "hsdp_replica_count": "replicas are read off the parameters' layouts; pass "
    "replicate_group= for plain replicated parameters",
    "ns_variant": "pass ns_coefficients= (an hp_muon.PRESETS name or per-step triples)",
}
_ADAMW = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
_ADAMW_NATIVE = ("foreach", "capturable", "differentiable", "fused")


def _options(
    kind: str, given: Mapping[str, Any] | None, known: tuple[str, ...], instead: Mapping[str, str]
) -> dict[str, Any]:
    """``given`` with upstream's ``<kind>_`` prefixes dropped; unknown keys refused."""
    out: dict[str, Any] = {}
    for key, value in (given or {}).items():
        name = key.removeprefix(f"{kind}_")
        if name in instead:
            raise not_offered(f"get_hyper_optimizer({kind}_kwargs={{{key!r}: ...}})", instead[name])
        if name not in known:
            raise TypeError(
                f"get_hyper_optimizer: unknown {kind} option {key!r}; {kind}_kwargs takes "
                f"{', '.join(known)} (with or without the '{kind}_' prefix)"
            )
        out[name] = value
    return out


def _muon_arguments(options: dict[str, Any]) -> dict[str, Any]:
    rms = options.pop("matched_adamw_rms", MATCHED_ADAMW_RMS)
    if rms != MATCHED_ADAMW_RMS:
        raise not_offered(
            f"get_hyper_optimizer(muon_kwargs={{'matched_adamw_rms': {rms}}})",
            f"hp-muon matches AdamW's update RMS at {MATCHED_ADAMW_RMS} only "
            "(adjust_lr_fn='match_rms_adamw'); scale lr instead",
        )
    steps = options.get("ns_steps", 5)
    if "ns_coefficients" not in options and steps > 5:
        raise not_offered(
            f"get_hyper_optimizer(muon_kwargs={{'ns_steps': {steps}}})",
            "upstream's Newton-Schulz has 5 coefficient triples: pass ns_steps <= 5, or "
            "ns_coefficients= for more steps",
        )
    return {
        "ns_coefficients": UPSTREAM_NS_COEFFICIENTS,
        "adjust_lr_fn": "match_rms_adamw",
        "lr": 2e-2,  # upstream's default
        **options,
    }


@adapts(
    "hp_muon.muon_with_adamw",
    "upstream's param groups and `muon_kwargs=`/`adamw_kwargs=`, with upstream's numerics",
)
def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Iterable[Any],
    adamw_params: Iterable[Any],
    muon_kwargs: Mapping[str, Any] | None = None,
    adamw_kwargs: Mapping[str, Any] | None = None,
) -> ChainedOptimizer:
    """Muon on ``muon_params`` chained with AdamW on ``adamw_params`` (upstream's arguments).

    Args:
        model: the model the parameters belong to.
        muon_params, adamw_params: parameters or param-group dicts (``{"params": [...],
            "lr": ...}``); an empty list leaves that optimizer out.
        muon_kwargs: upstream's Muon options (``lr``, ``weight_decay``, ``momentum``,
            ``nesterov``, ``ns_steps``, ``matched_adamw_rms``; a ``muon_`` prefix is
            dropped) and hp-muon's own (``ns_coefficients``, ``ns_dtype``, ...).
        adamw_kwargs: ``torch.optim.AdamW``'s options (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ...; an ``adamw_`` prefix is dropped).

    Returns:
        An ``hp_muon.ChainedOptimizer`` (``step``, ``zero_grad``, ``param_groups``,
        ``state_dict`` over both).

    Raises:
        NotOfferedError: an upstream option hp-muon does not implement (the message says what
            to use); TypeError for an unknown option; ValueError if both lists are empty.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_hyper_optimizer: model must be an nn.Module, got {type(model)}")
    muon_groups, adamw_groups = list(muon_params), list(adamw_params)
    muon_options = _options("muon", muon_kwargs, (*_MUON_UPSTREAM, *_MUON_NATIVE), _MUON_INSTEAD)
    adamw_options = _options("adamw", adamw_kwargs, (*_ADAMW, *_ADAMW_NATIVE), {})
    optimizers: list[torch.optim.Optimizer] = []
    if adamw_groups:
        optimizers.append(torch.optim.AdamW(adamw_groups, **adamw_options))
    if muon_groups:
        optimizers.append(Muon(muon_groups, **_muon_arguments(muon_options)))
    if not optimizers:
        raise ValueError("get_hyper_optimizer: muon_params and adamw_params are both empty")
    return ChainedOptimizer(optimizers)
