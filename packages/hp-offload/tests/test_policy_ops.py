"""Which ATen ops each policy kind covers, what recomputing them costs, and the selective
policy against torch's own selective checkpointing.

The oracles are written here: the op lists of each kind are spelled out below (not imported
from ``hp_offload.policy``), FLOPs are the textbook ``2 m n k`` per matmul written from the
shapes, and the reference run is ``torch.utils.checkpoint`` with ``MUST_SAVE`` for exactly
the listed ops. The layer runs every matmul flavour and the fused attention with shapes that
differ in every dimension, so a missing op or a transposed shape shows.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from hp_offload import ActivationPolicy, BudgetPolicy, checkpoint_wrapper
from hp_offload.policy import op_cost, op_kind

aten = torch.ops.aten
# Written out here on purpose: a test that imported the package's sets would change with them.
MATMULS = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default]
CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


class _EveryMatmul(nn.Module):
    """addmm, mm, bmm, baddbmm and CPU flash attention, with pointwise ops between them."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.bias = nn.Parameter(torch.randn(7, generator=g))
        self.w1 = nn.Parameter(torch.randn(5, 7, generator=g) / 3)
        self.w2 = nn.Parameter(torch.randn(7, 4, generator=g) / 3)
        self.w3 = nn.Parameter(torch.randn(2, 4, 9, generator=g) / 3)
        self.wq = nn.Parameter(torch.randn(9, 24, generator=g) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [6, 5]
        h = torch.addmm(self.bias, x, self.w1)  # [6, 7]
        h = torch.mm(torch.tanh(h), self.w2).reshape(2, 3, 4)  # [6, 4] -> [2, 3, 4]
        u = torch.bmm(h, self.w3)  # [2, 3, 9]
        u = torch.baddbmm(u, h.sin(), self.w3)  # [2, 3, 9]
        q = (u.reshape(6, 9) @ self.wq).reshape(2, 3, 3, 8).transpose(1, 2)  # [2, 3, 3, 8]
        k = torch.cat([q, q.cos()], dim=2)  # [2, 3, 6, 8]: s_k differs from s_q
        a = F.scaled_dot_product_attention(q, k, k.exp())
        return a.sigmoid().sum(dim=(1, 3))


class _Counting(TorchDispatchMode):
    """Counts the ATen ops that reach it (below any mode pushed after it)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: Counter[torch._ops.OpOverload] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


class _Recording(TorchDispatchMode):
    """Records every op call with its arguments and output."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[torch._ops.OpOverload, tuple[Any, ...], Any]] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, out))
        return out


def _input() -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _backward_ops(layer: nn.Module, call: Any) -> tuple[Counter[Any], list[torch.Tensor]]:
    """Ops run by the backward (recomputation included), and the gradients."""
    x = _input()
    out = call(x)
    with _Counting() as counter:
        out.pow(2).sum().backward()
    grads = [x.grad, *(p.grad for p in layer.parameters())]
    assert all(g is not None for g in grads)
    return counter.calls, [g for g in grads if g is not None]


@pytest.mark.parametrize(
    ("kinds", "ops"),
    [
        (["matmul"], MATMULS),
        (["attention"], [CPU_ATTENTION]),
        (["matmul", "attention"], [*MATMULS, CPU_ATTENTION]),
    ],
    ids=["matmul", "attention", "both"],
)
def test_selective_kinds_save_exactly_torchs_listed_ops(
    kinds: list[str], ops: list[torch._ops.OpOverload]
) -> None:
    ours = _EveryMatmul()
    checkpoint_wrapper(ours, ActivationPolicy.build(save=kinds))  # type: ignore[arg-type]
    ours_ops, ours_grads = _backward_ops(ours, ours)

    ref = _EveryMatmul()
    context = functools.partial(create_selective_checkpoint_contexts, ops)

    def reference(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(ref.forward, x, use_reentrant=False, context_fn=context)
        return out

    ref_ops, ref_grads = _backward_ops(ref, reference)
    # A saved op is not run again in backward; every other op is recomputed: the same ops
    # must run as under torch's selective checkpointing of exactly the listed ops.
    assert ours_ops == ref_ops
    assert all(torch.equal(a, b) for a, b in zip(ours_grads, ref_grads, strict=True))
    # And the listed ops really were saved: recompute-everything runs each of them once more
    # per forward call.
    with _Counting() as forward:
        _EveryMatmul()(_input())
    full = _EveryMatmul()
    checkpoint_wrapper(full)
    full_ops, _ = _backward_ops(full, full)
    for op in ops:
        assert forward.calls[op] > 0, op
        assert full_ops[op] - ref_ops[op] == forward.calls[op], op


def test_op_kinds() -> None:
    for op in MATMULS:
        assert op_kind(op) == "matmul", op
    assert op_kind(CPU_ATTENTION) == "attention"
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        assert op_kind(getattr(aten, name).default) == "attention", name
    for op in (aten.add.Tensor, aten.tanh.default, aten.sigmoid.default, aten.mul.Tensor):
        assert op_kind(op) == "pointwise", op
    for op in (aten.sum.dim_IntList, aten._softmax.default, aten.cat.default, aten.view.default):
        assert op_kind(op) == "other", op


def test_op_cost_is_the_textbook_flop_count() -> None:
    layer = _EveryMatmul()
    with torch.no_grad(), _Recording() as rec:
        layer(_input().detach())
    expected_matmul = {
        aten.addmm.default: 2 * 6 * 5 * 7,  # [6, 5] @ [5, 7]
        aten.mm.default: [2 * 6 * 7 * 4, 2 * 6 * 9 * 24],  # [6, 7] @ [7, 4]; [6, 9] @ [9, 24]
        aten.bmm.default: 2 * 2 * 3 * 4 * 9,  # [2, 3, 4] @ [2, 4, 9]
        aten.baddbmm.default: 2 * 2 * 3 * 4 * 9,
        # Two batched matmuls of b = 2, h = 3, s_q = 3, s_k = 6, d = 8.
        CPU_ATTENTION: 4 * 2 * 3 * 3 * 6 * 8,
    }
    seen: Counter[torch._ops.OpOverload] = Counter()
    for func, args, out in rec.calls:
        cost = op_cost(func, args, out)
        if func in expected_matmul:
            want = expected_matmul[func]
            if isinstance(want, list):
                want = want[seen[func]]
            seen[func] += 1
            assert cost == want, func
        elif func._schema.is_mutable or any(r.alias_info for r in func._schema.returns):
            assert cost == 0, func  # views and in-place ops: nothing to save
        else:
            assert cost == out.numel(), func  # one FLOP per output element
    assert seen == {
        aten.addmm.default: 1,
        aten.mm.default: 2,
        aten.bmm.default: 1,
        aten.baddbmm.default: 1,
        CPU_ATTENTION: 1,
    }


def test_budget_ties_go_to_the_earlier_op() -> None:
    mul, mm = aten.mul.Tensor, aten.mm.default
    # Equal value per byte (0.25); only one fits: the earlier one.
    assert BudgetPolicy(40).plan([(mul, 10.0, 40), (mm, 5.0, 20)]) == frozenset({0})
    assert BudgetPolicy(40).plan([(mm, 5.0, 20), (mul, 10.0, 40)]) == frozenset({0})


def test_swap_below_min_bytes_is_saved() -> None:
    policy = ActivationPolicy.build(swap=["matmul"], save=["pointwise"], swap_min_bytes=100)
    mm = aten.mm.default
    assert policy.action(mm, torch.empty(24)) == "save"  # 96 bytes
    assert policy.action(mm, torch.empty(25)) == "swap"  # 100 bytes
    assert policy.action(mm, (torch.empty(20), torch.empty(20))) == "swap"  # 160 in all
    assert policy.action(aten.tanh.default, torch.empty(1000)) == "save"
    assert policy.action(aten.sum.default, torch.empty(1000)) == "recompute"
    assert policy.uses_swap
    assert not ActivationPolicy.build(save=["matmul"]).uses_swap
