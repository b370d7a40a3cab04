"""The sharding-rule registry: one pure function per op, looked up by the called function.

A rule receives an :class:`OpCall` (the call's arguments with every DTensor replaced by its
``hp_layout.Layout``) and returns a :class:`ShardingDecision`: the layout each DTensor input
must have (the executor redistributes inputs that differ), the layout of each output, and
optionally different arguments or a different function for the local computation. Rules do
not touch data. An op without a rule is an error naming the op and its input layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from hp_layout import Layout, Mesh

__all__ = [
    "OpCall",
    "ReplicatedResult",
    "Rule",
    "ShardingDecision",
    "ShardingRuleError",
    "canonical_name",
    "register_sharding_rule",
    "rule_for",
    "torch_functions",
]


class ShardingRuleError(NotImplementedError):
    """An op has no sharding rule, or its rule rejects the given input layouts."""


@dataclass(frozen=True)
class OpCall:
    """One call of an op on DTensors, as a rule sees it.

    Attributes:
        func: the function that was called (``torch.add``, ``torch.Tensor.__add__``, ...).
        name: canonical op name (``"add"`` for all of those; ``"radd"`` for reflected forms).
        args: positional arguments, each DTensor replaced by its layout.
        kwargs: keyword arguments, likewise.
        rank: the global rank running the op (for rules whose local work depends on it).
        inplace: True for in-place forms (``add_``, ``__iadd__``).
    """

    func: Callable[..., Any]
    name: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    rank: int
    inplace: bool = False

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """Layouts of the DTensor arguments, in flattened ``(args, kwargs)`` order."""
        flat, _ = tree_flatten((self.args, dict(self.kwargs)))
        return tuple(x for x in flat if isinstance(x, Layout))

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional argument ``index`` or keyword ``name``."""
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    def describe(self) -> str:
        """``name(layout, ...)`` for error messages."""
        parts = [repr(a) for a in self.args]
        parts += [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


@dataclass(frozen=True)
class ShardingDecision:
    """What a rule decides for one call.

    Attributes:
        inputs: the layout each DTensor argument must have, in flattened ``(args, kwargs)``
            order; the executor redistributes any argument whose layout differs.
        outputs: the output layouts, shaped like the op's output (a Layout for a tensor, a
            :class:`ReplicatedResult` for a replicated tensor whose shape depends on the
            values, None for a non-tensor, tuples/lists for sequences).
        local_args: positional arguments for the local call, with a Layout wherever a
            (redistributed) local tensor goes; None keeps the call's arguments.
        local_kwargs: keyword arguments for the local call, likewise.
        local_func: the function to call on local tensors; None calls the op itself.
    """

    inputs: tuple[Layout, ...]
    outputs: Any
    local_args: tuple[Any, ...] | None = None
    local_kwargs: Mapping[str, Any] | None = field(default=None)
    local_func: Callable[..., Any] | None = None


@dataclass(frozen=True)
class ReplicatedResult:
    """An output whose shape depends on the values (``nonzero``, ``one_hot`` without
    ``num_classes``): the rule gives it instead of a Layout when every input is replicated,
    so each rank computes the same whole result. The output is ``Replicate`` on every axis of
    ``mesh``, with the shape the local computation returns.
    """

    mesh: Mesh


Rule = Callable[[OpCall], ShardingDecision]

_RULES: dict[Any, Rule] = {}


def canonical_name(func: Callable[..., Any]) -> tuple[str, bool]:
    """``(name, inplace)`` of a torch function: ``__iadd__`` -> ``("add", True)``,
    ``__setitem__`` -> ``("setitem", True)``."""
    name = getattr(func, "__name__", repr(func))
    if name == "__setitem__":
        return "setitem", True
    if name.startswith("__i") and name.endswith("__") and name[3:-2] in _DUNDER_INPLACE:
        return name[3:-2], True
    if name.startswith("__r") and name.endswith("__") and name[3:-2] in _DUNDER_INPLACE:
        return "r" + name[3:-2], False
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2], False
    if name.endswith("_") and not name.startswith("_"):
        return name[:-1], True
    return name, False


_DUNDER_INPLACE = {
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "pow",
    "mod",
    "and",
    "or",
    "xor",
    "matmul",
}


def torch_functions(*names: str, inplace: bool = True, dunder: bool = True) -> list[Any]:
    """Every torch entry point for ``names``: ``torch.x``, ``Tensor.x``, ``Tensor.x_``,
    ``Tensor.__x__`` / ``__rx__`` / ``__ix__``, ``torch.nn.functional.x``, ``torch.special.x``.
    """
    found: list[Any] = []
    for name in names:
        candidates = [
            (torch, name),
            (torch.Tensor, name),
            (torch.nn.functional, name),
            (torch.special, name),
        ]
        if inplace:
            candidates += [(torch.Tensor, name + "_"), (torch, name + "_")]
        if dunder:
            candidates += [(torch.Tensor, f"__{name}__"), (torch.Tensor, f"__r{name}__")]
            if inplace:
                candidates.append((torch.Tensor, f"__i{name}__"))
        for owner, attr in candidates:
            func = getattr(owner, attr, None)
            if func is not None and func not in found:
                found.append(func)
    return found


def register_sharding_rule(*funcs: Any) -> Callable[[Rule], Rule]:
    """Register a rule for each of ``funcs`` (functions or methods as torch calls them).

    Users register rules for their own ops the same way; a later registration replaces an
    earlier one.
    """
    if not funcs:
        raise ValueError("register_sharding_rule needs at least one function")

    def decorate(rule: Rule) -> Rule:
        for func in _expand(funcs):
            _RULES[func] = rule
        return rule

    return decorate


def _expand(funcs: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for func in funcs:
        if isinstance(func, list | tuple):
            out.extend(func)
        else:
            out.append(func)
    return out


def rule_for(func: Any) -> Rule | None:
    """The rule registered for ``func``, if any."""
    return _RULES.get(func)
