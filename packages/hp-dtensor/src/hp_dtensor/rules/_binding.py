"""Naming a call's arguments for rules of ops with many optional arguments (nn ops, losses).

A rule binds the call's arguments to the op's parameter names (:func:`bind`), decides a
target layout per DTensor argument by name, and lets the local computation receive the local
tensors by name too (:func:`named_decision`), so the rule never depends on whether an argument
was passed positionally or by keyword.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hp_dtensor.rules.registry import OpCall, ShardingDecision, ShardingRuleError
from hp_layout import Layout

__all__ = ["Bound", "bind", "named_decision", "ordered"]


@dataclass(frozen=True)
class Bound:
    """A call's arguments by parameter name, and which of them are DTensors.

    Attributes:
        values: every given argument by name (defaults are not filled in).
        tensor_names: names of the DTensor (Layout) arguments, in the flattened
            ``(args, kwargs)`` order the executor pairs decisions with.
    """

    values: dict[str, Any]
    tensor_names: tuple[str, ...]

    def get(self, name: str, default: Any = None) -> Any:
        """The argument ``name``, or ``default`` when it was not given."""
        return self.values.get(name, default)

    def layout(self, name: str) -> Layout | None:
        """The layout of DTensor argument ``name``, or None when it is not a DTensor."""
        value = self.values.get(name)
        return value if isinstance(value, Layout) else None


def bind(call: OpCall, params: Sequence[str]) -> Bound:
    """Name ``call``'s arguments after ``params`` (positional parameter order)."""
    if len(call.args) > len(params):
        raise ShardingRuleError(
            f"{call.name}: got {len(call.args)} positional arguments, expected at most "
            f"{len(params)} ({', '.join(params)})"
        )
    values: dict[str, Any] = dict(zip(params, call.args, strict=False))
    order = list(values)
    for key, value in call.kwargs.items():
        if key in values:
            raise ShardingRuleError(f"{call.name}: argument {key!r} given twice")
        values[key] = value
        order.append(key)
    names = tuple(n for n in order if isinstance(values[n], Layout))
    if len(names) != len(call.layouts):
        raise ShardingRuleError(
            f"{call.describe()}: DTensors nested inside argument containers are not supported; "
            "pass each tensor as its own argument"
        )
    return Bound(values, names)


def ordered(bound: Bound, targets: Mapping[str, Layout], op: str) -> tuple[Layout, ...]:
    """The target layouts in the order of the call's DTensor arguments."""
    missing = [n for n in bound.tensor_names if n not in targets]
    if missing:
        raise ShardingRuleError(f"{op}: unexpected DTensor argument(s) {missing}")
    return tuple(targets[n] for n in bound.tensor_names)


def _call_named(
    impl: Callable[..., Any],
    names: tuple[str, ...],
    static: Mapping[str, Any],
    *tensors: torch.Tensor,
) -> Any:
    """Call ``impl`` with the local tensors by name plus the static arguments."""
    return impl(**static, **dict(zip(names, tensors, strict=True)))


def named_decision(
    bound: Bound,
    targets: Mapping[str, Layout],
    outputs: Any,
    impl: Callable[..., Any],
    static: Mapping[str, Any],
    op: str,
) -> ShardingDecision:
    """A decision whose local work is ``impl(**static, **local_tensors_by_name)``."""
    inputs = ordered(bound, targets, op)
    local_func = functools.partial(_call_named, impl, bound.tensor_names, dict(static))
    return ShardingDecision(
        inputs, outputs, local_args=inputs, local_kwargs={}, local_func=local_func
    )
