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

from hp_muon import ChainedOptimizer, Muon, check_muon_params
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


def _muon_groups(model: nn.Module, given: list[Any]) -> list[Any]:
    """``given`` (parameters or group dicts) with each group's parameters in a list, checked by
    ``hp_muon.check_muon_params``: refuses what would leave Muon nothing to step or a parameter
    that is not a matrix, naming parameters by the model's names."""
    names = {id(p): name for name, p in model.named_parameters()}
    if not given:
        check_muon_params(
            [], "get_hyper_optimizer: muon_params", model_params=model.named_parameters()
        )
    out: list[Any] = []
    for index, group in enumerate(given):
        if isinstance(group, dict):
            raw = group["params"]
            params = [raw] if isinstance(raw, torch.Tensor) else list(raw)
            where = f"get_hyper_optimizer: muon_params group {index}"
            out.append({**group, "params": params})
        else:
            params, where = [group], "get_hyper_optimizer: muon_params"
            out.append(group)
        check_muon_params(
            params,
            where,
            names=[names.get(id(p), f"muon_params[{index}]") for p in params],
            model_params=model.named_parameters(),
        )
    return out


@adapts(
    "hp_muon.muon_with_adamw",
    "upstream's param groups and `muon_kwargs=`/`adamw_kwargs=`, with upstream's numerics; "
    "an empty Muon group or a non-matrix Muon parameter refused",
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
        model: the model the parameters belong to (errors name parameters by its names).
        muon_params, adamw_params: parameters or param-group dicts (``{"params": [...],
            "lr": ...}``); an empty ``adamw_params`` leaves AdamW out. ``muon_params`` must
            hold the matrices: parameters whose global shape has 2 or more dims. Under
            :func:`hyper_parallel.fully_shard` they are DTensors of their global shape, so
            upstream's ``p.ndim == 2`` rule selects them (under tensor parallelism they are
            flat 1-d pieces: select by ``hp_dtensor.layout_of(p).global_shape``).
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
            to use); TypeError for an unknown option.
        ValueError: ``muon_params`` is empty or holds an empty group (Muon would step nothing
            and the matrices would silently train with AdamW or not at all; when the model
            holds hp-fsdp flat 1-d pieces of matrices the message names one and
            ``param_layout="per_param"``), or a Muon parameter whose global shape has fewer
            than 2 dims (named).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_hyper_optimizer: model must be an nn.Module, got {type(model)}")
    muon_groups, adamw_groups = _muon_groups(model, list(muon_params)), list(adamw_params)
    muon_options = _options("muon", muon_kwargs, (*_MUON_UPSTREAM, *_MUON_NATIVE), _MUON_INSTEAD)
    adamw_options = _options("adamw", adamw_kwargs, (*_ADAMW, *_ADAMW_NATIVE), {})
    optimizers: list[torch.optim.Optimizer] = []
    if adamw_groups:
        optimizers.append(torch.optim.AdamW(adamw_groups, **adamw_options))
    optimizers.append(Muon(muon_groups, **_muon_arguments(muon_options)))
    return ChainedOptimizer(optimizers)
