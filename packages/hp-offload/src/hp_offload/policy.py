"""Per-layer activation policies: which op outputs to save, swap to host, or recompute.

Two kinds of policy drive :func:`hp_offload.checkpoint.checkpoint_wrapper`:

* :class:`ActivationPolicy`: an action (``"save"``, ``"swap"``, ``"recompute"``) per op kind
  (``"matmul"``, ``"attention"``, ``"pointwise"``, ``"other"``) or per exact ``OpOverload``;
* :class:`BudgetPolicy`: save the op outputs with the highest recompute cost per byte until a
  byte budget per layer call is spent, recompute the rest (the exact rule is in its docstring).

Ops are the ATen ops a layer's forward runs below autograd (what a ``TorchDispatchMode``
sees): ``nn.Linear`` shows up as ``aten.mm``/``aten.addmm``, SDPA as one of the fused
``_scaled_dot_product_*`` ops, and so on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "ATTENTION_OPS",
    "FULL_RECOMPUTE",
    "MATMUL_OPS",
    "Action",
    "ActivationPolicy",
    "BudgetPolicy",
    "OpKind",
    "op_cost",
    "op_kind",
]

Action = Literal["save", "swap", "recompute"]
OpKind = Literal["matmul", "attention", "pointwise", "other"]
_ACTIONS: frozenset[str] = frozenset(("save", "swap", "recompute"))
_KINDS: frozenset[str] = frozenset(("matmul", "attention", "pointwise", "other"))

_aten = torch.ops.aten
MATMUL_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
)
"""The ATen ops of kind ``"matmul"`` (``linear`` and ``matmul`` decompose into them)."""

ATTENTION_OPS: frozenset[torch._ops.OpOverload] = frozenset(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
)
"""The fused scaled-dot-product attention ops, kind ``"attention"``."""


def op_kind(func: torch._ops.OpOverload) -> OpKind:
    """The kind of an ATen op.

    Postcondition: ``"matmul"`` for :data:`MATMUL_OPS`, ``"attention"`` for
    :data:`ATTENTION_OPS`, ``"pointwise"`` for ops tagged ``torch.Tag.pointwise``, else
    ``"other"`` (reductions, views, softmax, cat, ...).
    """
    if func in MATMUL_OPS:
        return "matmul"
    if func in ATTENTION_OPS:
        return "attention"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    return "other"


def aliasing(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` returns a view of an input or mutates one."""
    return func._schema.is_mutable or any(r.alias_info is not None for r in func._schema.returns)


_EMPTY = frozenset(
    f"aten::{n}"
    for n in (
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
    )
)


def factory(func: torch._ops.OpOverload, args: tuple[object, ...]) -> bool:
    """Whether an op call makes a fresh tensor from no tensor data: no tensor argument, or an
    ``empty*`` op (whose output is filled in place later, as dropout's mask)."""
    return func._schema.name in _EMPTY or not any(isinstance(a, torch.Tensor) for a in args)


def _numel(x: object) -> int:
    return x.numel() if isinstance(x, torch.Tensor) else 0


def op_cost(func: torch._ops.OpOverload, args: tuple[object, ...], out: object) -> float:
    """Estimated FLOPs to recompute one call of ``func`` (what saving its output avoids).

    Postcondition: ``2*m*n*k`` for ``mm``/``addmm`` and ``2*b*m*n*k`` for ``bmm``/``baddbmm``;
    ``4*b*h*s_q*s_k*d`` for attention (two batched matmuls); otherwise the number of output
    elements (one FLOP per element); 0 for ops with no tensor output and for ops that return a
    view of or mutate an input (nothing to save).
    """
    if aliasing(func):
        return 0.0
    if func in MATMUL_OPS:
        a, b = (
            (args[1], args[2]) if func in (_aten.addmm.default, _aten.baddbmm.default) else args[:2]
        )
        assert isinstance(a, torch.Tensor)
        assert isinstance(b, torch.Tensor)
        return 2.0 * a.numel() * b.shape[-1]
    if func in ATTENTION_OPS:
        q, k = args[0], args[1]
        assert isinstance(q, torch.Tensor)
        assert isinstance(k, torch.Tensor)
        return 4.0 * q.numel() * k.shape[-2]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return float(sum(_numel(o) for o in outs))


def _out_bytes(out: object) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))


@dataclass(frozen=True)
class ActivationPolicy:
    """An action per op for the outputs a layer's forward produces.

    Attributes:
        rules: op kind (see :func:`op_kind`) or exact ``OpOverload`` -> action. An exact op
            wins over its kind.
        default: the action for ops no rule names.
        swap_min_bytes: outputs smaller than this are saved on the device even when the
            rule says ``"swap"`` (a copy costs more than it frees).

    ``"save"`` keeps the output on the device for backward; ``"swap"`` keeps it in host memory
    and brings it back before the layer's backward (prefetched one layer ahead);
    ``"recompute"`` runs the op again in backward. Tensors that autograd saves *inside* the
    layer are never held: the wrapper recomputes what is not saved or swapped.
    """

    rules: Mapping[OpKind | torch._ops.OpOverload, Action] = field(default_factory=dict)
    default: Action = "recompute"
    swap_min_bytes: int = 0

    def __post_init__(self) -> None:
        for key, action in self.rules.items():
            if isinstance(key, torch._ops.OpOverloadPacket):
                raise TypeError(
                    f"rule key {key} is an op packet; name an overload, e.g. {key}.default"
                )
            if not isinstance(key, torch._ops.OpOverload) and key not in _KINDS:
                raise ValueError(
                    f"rule key {key!r} is neither an op kind {sorted(_KINDS)} nor an OpOverload"
                )
            if action not in _ACTIONS:
                raise ValueError(f"action {action!r} for {key!r} is not one of {sorted(_ACTIONS)}")
        if self.default not in _ACTIONS:
            raise ValueError(f"default {self.default!r} is not one of {sorted(_ACTIONS)}")
        if self.swap_min_bytes < 0:
            raise ValueError(f"swap_min_bytes must be >= 0, got {self.swap_min_bytes}")

    @classmethod
    def build(
        cls,
        *,
        save: Iterable[OpKind | torch._ops.OpOverload] = (),
        swap: Iterable[OpKind | torch._ops.OpOverload] = (),
        recompute: Iterable[OpKind | torch._ops.OpOverload] = (),
        default: Action = "recompute",
        swap_min_bytes: int = 0,
    ) -> ActivationPolicy:
        """A policy from three disjoint lists of op kinds or ops.

        Raises ValueError if one key is in two lists.
        """
        rules: dict[OpKind | torch._ops.OpOverload, Action] = {}
        for action, keys in (("save", save), ("swap", swap), ("recompute", recompute)):
            for key in keys:
                if key in rules:
                    raise ValueError(f"{key!r} is listed both as {rules[key]!r} and {action!r}")
                rules[key] = action  # type: ignore[assignment]
        return cls(rules=rules, default=default, swap_min_bytes=swap_min_bytes)

    def action(self, func: torch._ops.OpOverload, out: object) -> Action:
        """The action for one call of ``func`` with output ``out``.

        Postcondition: the exact-op rule, else the kind rule, else ``default``; ``"swap"`` is
        turned into ``"save"`` when the output is smaller than ``swap_min_bytes``.
        """
        act = self.rule_action(func)
        if act == "swap" and _out_bytes(out) < self.swap_min_bytes:
            return "save"
        return act

    def rule_action(self, func: torch._ops.OpOverload) -> Action:
        """The exact-op rule, else the kind rule, else ``default`` (no size test)."""
        act = self.rules.get(func)
        return act if act is not None else self.rules.get(op_kind(func), self.default)

    @property
    def uses_swap(self) -> bool:
        """Whether any op may be swapped."""
        return self.default == "swap" or "swap" in self.rules.values()


FULL_RECOMPUTE = ActivationPolicy()
"""Recompute everything (plain activation checkpointing)."""


@dataclass(frozen=True)
class BudgetPolicy:
    """Save the op outputs worth most per byte, up to ``budget_bytes`` per layer call.

    The rule, exactly: let one call of the layer's forward run the ATen ops ``o_1..o_n``
    (in order), where ``o_i`` has output bytes ``b_i > 0`` and recompute cost ``c_i =
    op_cost(o_i)`` (FLOPs). Visit the ops by ``c_i / b_i`` descending (ties: earlier op first)
    and put ``o_i`` in the saved set ``S`` when ``sum(b_j for j in S) + b_i <= budget_bytes``
    (a smaller op later in the order may still fit). Ops with ``c_i == 0`` or ``b_i == 0`` are
    never saved, nor are outputs that a later op of the same call mutates in place (e.g. the
    ``empty_like`` buffer dropout fills with ``bernoulli_``), which the first call detects.
    Everything outside ``S`` is recomputed.

    The plan is computed once per input signature (shapes, dtypes, devices of the tensor
    arguments) from that signature's first call, which runs as full recompute while it
    records the ops; every later call with the same signature applies the plan. A layer
    whose ops depend on the data (an expert-parallel MoE runs work per expert that received
    tokens) may depart from the plan's op sequence: from the first op that differs, that call
    saves nothing more; and a call never saves more than ``budget_bytes`` (output sizes can
    depend on the data too), whatever the plan.
    """

    budget_bytes: int

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")

    def plan(self, ops: list[tuple[torch._ops.OpOverload, float, int]]) -> frozenset[int]:
        """The saved set: positions in ``ops`` (``(func, cost, bytes)`` in run order).

        Postcondition: the greedy set of the class docstring; its byte sum is at most
        ``budget_bytes``.
        """
        order = sorted(
            (i for i, (_, cost, nbytes) in enumerate(ops) if cost > 0 and nbytes > 0),
            key=lambda i: (-ops[i][1] / ops[i][2], i),
        )
        chosen: set[int] = set()
        used = 0
        for i in order:
            if used + ops[i][2] <= self.budget_bytes:
                chosen.add(i)
                used += ops[i][2]
        return frozenset(chosen)


def signature(args: tuple[object, ...]) -> tuple[object, ...]:
    """Shapes, dtypes and devices of the tensor arguments (a :class:`BudgetPolicy` plan key)."""
    return tuple(
        (tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in args
    )


def out_bytes(out: object) -> int:
    """Bytes of the tensors in an op output (a tensor or a tuple/list of them)."""
    return _out_bytes(out)
