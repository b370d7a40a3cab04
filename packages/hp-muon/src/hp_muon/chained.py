"""Muon for the matrices, AdamW for the rest: the parameter split and one chained optimizer.

:func:`split_params` decides, by a documented rule that name patterns override, which
parameters Muon takes. :class:`ChainedOptimizer` steps several optimizers as one
``torch.optim.Optimizer``: one ``param_groups`` list (so LR schedulers work), one
``state_dict`` (so ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and
plain ``torch.save`` see one optimizer), one ``step`` and ``zero_grad``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import Optimizer

from hp_muon.checks import check_muon_params
from hp_muon.muon import Muon
from hp_muon.tensors import global_shape

__all__ = ["ChainedOptimizer", "ParamSplit", "muon_with_adamw", "split_params"]

DEFAULT_HEAD_NAMES: tuple[str, ...] = ("lm_head", "output")
"""Module names (last dotted component) taken as the LM head by :func:`split_params`."""


@dataclass(frozen=True)
class ParamSplit:
    """Parameters by optimizer, each as ``(name, parameter)`` in ``named_parameters`` order.

    Attributes:
        muon: parameters for Muon.
        adamw: parameters for AdamW.
    """

    muon: tuple[tuple[str, nn.Parameter], ...]
    adamw: tuple[tuple[str, nn.Parameter], ...]

    @property
    def muon_params(self) -> list[nn.Parameter]:
        """The Muon parameters alone."""
        return [p for _, p in self.muon]

    @property
    def adamw_params(self) -> list[nn.Parameter]:
        """The AdamW parameters alone."""
        return [p for _, p in self.adamw]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def split_params(
    model: nn.Module,
    *,
    muon_patterns: Sequence[str] = (),
    adamw_patterns: Sequence[str] = (),
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    head_with_muon: bool = False,
) -> ParamSplit:
    """Split ``model``'s trainable parameters between Muon and AdamW.

    The rule, in order:

    1. a name matching ``muon_patterns`` (``fnmatch`` on the full dotted name) goes to Muon,
       one matching ``adamw_patterns`` to AdamW (matching both is an error);
    2. parameters with fewer than 2 dims (biases, norms, scalars) go to AdamW; the dims are
       the whole parameter's (``hp_dtensor.layout_of``), not those of a sharder's local piece;
    3. parameters of ``nn.Embedding``/``nn.EmbeddingBag`` modules go to AdamW (a lookup table is
       not a linear map Muon's geometry fits);
    4. parameters of modules whose last name component is in ``head_names`` (the LM head) go to
       AdamW unless ``head_with_muon``;
    5. every other parameter (matrices, expert stacks) goes to Muon.

    Parameters without ``requires_grad`` are left out; a parameter shared by several modules
    (tied weights) is listed once, under its first name.

    Raises:
        ValueError: a name matches both pattern lists, or a forced-Muon parameter has fewer
            than 2 dims.
    """
    owner_kind: dict[int, str] = {}
    for module_name, module in model.named_modules():
        kind = "other"
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            kind = "embedding"
        elif module_name.rsplit(".", 1)[-1] in head_names:
            kind = "head"
        for p in module.parameters(recurse=False):
            owner_kind.setdefault(id(p), kind)
    muon: list[tuple[str, nn.Parameter]] = []
    adamw: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        forced_muon, forced_adamw = _matches(name, muon_patterns), _matches(name, adamw_patterns)
        # A sharder's local piece (hp-fsdp's 1-d flat ranges) counts by its whole shape.
        dims = len(global_shape(p))
        if forced_muon and forced_adamw:
            raise ValueError(f"parameter {name!r} matches both muon_patterns and adamw_patterns")
        if forced_muon and dims < 2:
            raise ValueError(
                f"parameter {name!r} of shape {global_shape(p)} matches muon_patterns but Muon "
                "needs at least 2 dims"
            )
        kind = owner_kind.get(id(p), "other")
        to_muon = forced_muon or (
            not forced_adamw
            and dims >= 2
            and kind != "embedding"
            and (kind != "head" or head_with_muon)
        )
        (muon if to_muon else adamw).append((name, p))
    return ParamSplit(tuple(muon), tuple(adamw))


class _ChainedState(MutableMapping[torch.Tensor, Any]):
    """The per-parameter state of every chained optimizer, as one mapping."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self._optimizers = optimizers
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}

    def _of(self, key: torch.Tensor) -> MutableMapping[torch.Tensor, Any]:
        owner = self._owner.get(id(key))
        if owner is None:
            raise KeyError("the tensor is not a parameter of any chained optimizer")
        state: MutableMapping[torch.Tensor, Any] = owner.state
        return state

    def __getitem__(self, key: torch.Tensor) -> Any:
        return self._of(key)[key]

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        self._of(key)[key] = value

    def __delitem__(self, key: torch.Tensor) -> None:
        del self._of(key)[key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, torch.Tensor) and id(key) in self._owner and key in self._of(key)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class ChainedOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, stepped and checkpointed as one.

    ``param_groups`` lists the chained optimizers' groups in order (the same dict objects, so
    a scheduler changing ``group["lr"]`` changes the chained optimizer's group), ``state`` is
    their merged per-parameter state, ``state_dict`` is torch's format over all groups, and
    ``load_state_dict`` hands each optimizer its own groups back.

    Raises:
        ValueError: no optimizers, or a parameter in two of them.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.optimizers: tuple[Optimizer, ...] = tuple(optimizers)
        self._initializing = True
        # Optimizer.__init__ appends these very dicts (and rejects a parameter in two groups).
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self._initializing = False
        self.state = _ChainedState(self.optimizers)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: add groups to one of :attr:`optimizers`, then chain anew."""
        if not getattr(self, "_initializing", False):
            raise RuntimeError(
                "add the group to one of the chained optimizers (ChainedOptimizer.optimizers) "
                "and build a new ChainedOptimizer"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Evaluate ``closure`` once (with grad), then step, in order, every optimizer that has
        a parameter in its groups. One whose groups are all empty is not stepped: it has
        nothing to update, and a wrapper stepping the chain in parts (``hp_offload``'s
        ``OffloadedOptimizer``, a bucket at a time) empties a joint member's groups in every
        part but the one that steps it whole, where a step with no parameters would still
        overwrite its last-step statistics and check its plan against nothing."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            if any(g["params"] for g in o.param_groups):
                o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` of every optimizer."""
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this chain's format: its groups, in order, go back to the
        optimizers they came from.

        Raises:
            ValueError: the group count or a group's parameter count differs.
        """
        groups = list(state_dict["param_groups"])
        state = state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} parameter groups, this chain "
                f"{len(self.param_groups)} ({[len(o.param_groups) for o in self.optimizers]} per "
                "optimizer)"
            )
        start = 0
        for o in self.optimizers:
            mine = groups[start : start + len(o.param_groups)]
            start += len(o.param_groups)
            ids = [i for g in mine for i in g["params"]]
            o.load_state_dict(
                {"state": {i: state[i] for i in ids if i in state}, "param_groups": mine}
            )
        # Each optimizer's load replaced its group dicts: chain the new ones (same list).
        self.param_groups[:] = [g for o in self.optimizers for g in o.param_groups]


def muon_with_adamw(
    model: nn.Module,
    *,
    muon: Mapping[str, Any] | None = None,
    adamw: Mapping[str, Any] | None = None,
    split: ParamSplit | None = None,
    muon_factory: Callable[..., Optimizer] | None = None,
) -> ChainedOptimizer:
    """Muon (``muon`` keyword arguments) on :func:`split_params`'s Muon parameters and
    ``torch.optim.AdamW`` (``adamw`` keyword arguments) on the rest, chained.

    ``muon_factory`` defaults to :class:`hp_muon.Muon`. A planner's step plan goes in
    ``muon``: ``muon={"plan": hp_muon.plan_muon(...)}`` (checked at the first step, see
    :class:`hp_muon.Muon`); plan the Muon part of the split, in its order.

    Raises:
        ValueError: the split gives Muon no parameters, or one whose global shape has fewer
            than 2 dims (:func:`hp_muon.check_muon_params`; the message names it): a chain
            whose Muon steps nothing would train every matrix with AdamW.
    """
    chosen = split or split_params(model)
    check_muon_params(
        chosen.muon_params,
        "muon_with_adamw: the Muon part of the split",
        names=[name for name, _ in chosen.muon],
        model_params=model.named_parameters(),
    )
    optimizers: list[Optimizer] = [(muon_factory or Muon)(chosen.muon_params, **dict(muon or {}))]
    if chosen.adamw:
        optimizers.append(torch.optim.AdamW(chosen.adamw_params, **dict(adamw or {})))
    return ChainedOptimizer(optimizers)
