"""checkpoint_wrapper: full and selective recompute, budgets, against torch.utils.checkpoint.

Every comparison is bit-equal (``torch.equal``) in fp32 on the CPU: recomputation replays the
same kernels on the same inputs, so no tolerance is needed.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from hp_offload.checkpoint import checkpoint_wrapper
from hp_offload.memory import ActivationMeter
from hp_offload.policy import ATTENTION_OPS, MATMUL_OPS, ActivationPolicy, BudgetPolicy, op_kind
from hp_offload.swap import Swapper, swap_wrapper, unwrap
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16, dropout=0.1
)

Result = tuple[list[torch.Tensor], list[torch.Tensor], int]


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _steps(model: nn.Module, steps: int = 2) -> Result:
    """Losses, last gradients and the meter's device peak of the last step."""
    ids = torch.randint(
        0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(3)
    )
    losses: list[torch.Tensor] = []
    peak = 0
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        with ActivationMeter(exclude=[*model.parameters(), *model.buffers()]) as meter:
            loss = model(ids).pow(2).mean()
            peak = meter.peak
            loss.backward()
        assert meter.live == 0
        assert meter.live_host == 0
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters() if p.grad is not None], peak


def _wrapped(wrap: Callable[[nn.Module], object]) -> Llama:
    model = _model()
    for layer in model.layers:
        wrap(layer)
    return model


class _TorchCheckpointed(nn.Module):
    """torch.utils.checkpoint around a block, optionally selective (the reference)."""

    def __init__(self, block: nn.Module, save_ops: list[torch._ops.OpOverload] | None) -> None:
        super().__init__()
        self.block = block
        self.save_ops = save_ops

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.save_ops is None:
            out: torch.Tensor = checkpoint(self.block, *args, use_reentrant=False)
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, self.save_ops)
            out = checkpoint(self.block, *args, use_reentrant=False, context_fn=ctx)
        return out


def _torch_reference(save_ops: list[torch._ops.OpOverload] | None) -> Result:
    model = _model()
    model.layers = nn.ModuleList(_TorchCheckpointed(b, save_ops) for b in model.layers)
    return _steps(model)


def _assert_equal(a: Result, b: Result) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert len(a[1]) == len(b[1])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.fixture(scope="module")
def plain() -> Result:
    return _steps(_model())


def test_full_recompute_equals_plain_and_torch(plain: Result) -> None:
    ours = _steps(_wrapped(checkpoint_wrapper))
    _assert_equal(ours, plain)
    _assert_equal(ours, _torch_reference(None))
    assert ours[2] < plain[2] / 3


def test_selective_by_op_equals_torch_sac(plain: Result) -> None:
    policy = ActivationPolicy.build(save=["matmul", "attention"])
    ours = _steps(_wrapped(lambda m: checkpoint_wrapper(m, policy)))
    _assert_equal(ours, plain)
    _assert_equal(ours, _torch_reference(sorted(MATMUL_OPS | ATTENTION_OPS, key=str)))
    full = _steps(_wrapped(checkpoint_wrapper))
    assert full[2] < ours[2] < plain[2]


def test_exact_op_rule_beats_kind() -> None:
    policy = ActivationPolicy.build(
        save=["matmul", torch.ops.aten.silu.default], default="recompute"
    )
    assert policy.action(torch.ops.aten.silu.default, None) == "save"
    assert policy.action(torch.ops.aten.mm.default, None) == "save"
    assert policy.action(torch.ops.aten.mul.Tensor, None) == "recompute"
    assert op_kind(torch.ops.aten.mul.Tensor) == "pointwise"
    assert op_kind(torch.ops.aten.sum.dim_IntList) == "other"


def test_budget_policy(plain: Result) -> None:
    layer_plain = plain[2]
    zero = _steps(_wrapped(lambda m: checkpoint_wrapper(m, BudgetPolicy(0))))
    full = _steps(_wrapped(checkpoint_wrapper))
    _assert_equal(zero, plain)
    assert zero[2] == full[2]
    budget = 3 * 4096
    some = _steps(_wrapped(lambda m: checkpoint_wrapper(m, BudgetPolicy(budget))))
    _assert_equal(some, plain)
    # each of the 3 layers holds at most `budget` more than full recompute
    assert full[2] < some[2] <= full[2] + CONFIG.n_layers * budget
    everything = _steps(_wrapped(lambda m: checkpoint_wrapper(m, BudgetPolicy(1 << 30))))
    _assert_equal(everything, plain)
    assert everything[2] > some[2]
    assert layer_plain > 0


def test_budget_plan_rule() -> None:
    mm, mul = torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor
    ops = [(mul, 10.0, 40), (mm, 1000.0, 40), (mm, 500.0, 100), (mul, 5.0, 20), (mm, 0.0, 8)]
    # value per byte: 0.25, 25, 5, 0.25, 0 -> order 1, 2, 0, 3 (tie: earlier first)
    assert BudgetPolicy(150).plan(ops) == frozenset({1, 2})
    assert BudgetPolicy(100).plan(ops) == frozenset({1, 0, 3})
    assert BudgetPolicy(0).plan(ops) == frozenset()


def test_no_grad_runs_unwrapped() -> None:
    model = _wrapped(checkpoint_wrapper)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(model(ids), _model()(ids))


def test_unwrap_brings_back_a_forward_set_on_the_instance() -> None:
    # A tensor-parallel style replaces a module's forward on the instance; wrapping and
    # unwrapping must leave that forward, not the class's.
    layer = nn.Linear(4, 4)
    layer.forward = types.MethodType(lambda self, x: x * 3.0, layer)  # type: ignore[method-assign]
    x = torch.ones(2, 4)
    for wrap in (checkpoint_wrapper, swap_wrapper):
        wrap(layer)
        unwrap(layer)
        assert torch.equal(layer(x), x * 3.0), wrap.__name__
    plain = nn.Linear(4, 4)
    checkpoint_wrapper(plain)
    unwrap(plain)
    assert "forward" not in plain.__dict__


def test_errors() -> None:
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="swapper"):
        checkpoint_wrapper(layer, ActivationPolicy.build(swap=["matmul"]))
    with pytest.raises(ValueError, match="swaps nothing"):
        checkpoint_wrapper(layer, ActivationPolicy(), swapper=Swapper())
    with pytest.raises(TypeError, match="ActivationPolicy or a BudgetPolicy"):
        checkpoint_wrapper(layer, "full")  # type: ignore[arg-type]
    checkpoint_wrapper(layer)
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_wrapper(layer)
    unwrap(layer)
    with pytest.raises(ValueError, match="not wrapped"):
        unwrap(layer)
    with pytest.raises(ValueError, match="both"):
        ActivationPolicy.build(save=["matmul"], recompute=["matmul"])
    with pytest.raises(ValueError, match="neither an op kind"):
        ActivationPolicy(rules={"conv": "save"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="overload"):
        ActivationPolicy(rules={torch.ops.aten.mm: "save"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="budget_bytes"):
        BudgetPolicy(-1)


class _AllReduceIdentity(torch.autograd.Function):
    """Megatron's ``g``: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _RowParallelMLP(nn.Module):
    """A TP-like MLP shard: column-parallel up, row-parallel down, all-reduce in forward."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.up = nn.Parameter(up)
        self.down = nn.Parameter(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.gelu(x @ self.up.t()) @ self.down.t()
        out: torch.Tensor = _AllReduceIdentity.apply(partial)  # type: ignore[no-untyped-call]
        return out


def _tp_rank(policy_name: str) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    up, down, x = (
        torch.randn(16, 8, generator=g),
        torch.randn(8, 16, generator=g),
        torch.randn(4, 8, generator=g),
    )
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)

    def run(wrap: bool) -> list[torch.Tensor]:
        layers = [_RowParallelMLP(up[rows].clone(), down[:, rows].clone()) for _ in range(2)]
        if wrap:
            for layer in layers:
                policy = (
                    ActivationPolicy.build(save=["matmul"])
                    if policy_name == "selective"
                    else ActivationPolicy()
                )
                checkpoint_wrapper(layer, policy)
        h = x.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        h.pow(2).sum().backward()
        return [p.grad for layer in layers for p in layer.parameters() if p.grad is not None]

    plain, wrapped = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True))
    return wrapped


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy_name", ["full", "selective"])
def test_tp_like_module_with_all_reduce(policy_name: str) -> None:
    grads = run_on_ranks(2, _tp_rank, policy_name, timeout=120)
    assert len(grads) == 2
    assert len(grads[0]) == 4
