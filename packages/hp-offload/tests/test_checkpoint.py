"""checkpoint_wrapper: full and selective recompute, budgets, against torch.utils.checkpoint.

Every comparison is bit-equal (``torch.equal``) in fp32 on the CPU: recomputation replays the
same kernels on the same inputs, so no tolerance is needed.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

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


class _DataDependent(nn.Module):
    """A layer whose ops depend on its input's values, as an expert-parallel MoE's do: an
    extra op first when ``x[0, 0] > 0`` (every later op one position on), matmuls over as
    many rows as ``x[0]`` has positive entries, and a sum scaled in place (calibration never
    saves it: torch would find the cached tensor mutated)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 1.5 if x[0, 0] > 0 else x
        rows = int((x[0] > 0).sum())
        for _ in range(2):
            t = out[:rows] @ self.weight + 1.0
            t.mul_(0.5)
            out = out + torch.tanh(t).sum()
        return out


def test_budget_policy_with_data_dependent_ops() -> None:
    """Calls that run other ops, or ops of other sizes, than the planned call for the same
    input shapes stay bit-equal and within the budget: the plan is followed up to the first
    op that differs, and a call saves at most the budget."""
    budget = 100
    plain, wrapped = _DataDependent(), _DataDependent()
    checkpoint_wrapper(wrapped, BudgetPolicy(budget))
    # (x[0, 0] > 0, rows): the first call plans. The same ops on 8 rows would save 4 x the
    # budget by the plan; without the extra op, the plan's positions fall on other ops, one
    # of them the sum scaled in place (on 1 row it would fit the budget).
    for shifted, rows in ((True, 1), (True, 8), (False, 1), (False, 7), (True, 1)):
        x = -torch.ones(6, 8)
        x[0, 1 : 1 + rows - shifted] = 1.0
        x[0, 0] = 1.0 if shifted else -1.0
        results = []
        for layer in (plain, wrapped):
            layer.zero_grad()
            with ActivationMeter(exclude=list(layer.parameters())) as meter:
                out = layer(x.clone().requires_grad_())
                held = meter.live
                out.pow(2).sum().backward()
            assert layer.weight.grad is not None
            results.append((out.detach(), layer.weight.grad.clone(), held))
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(results[0][1], results[1][1])
        assert results[1][2] <= x.numel() * 4 + budget  # the input, and at most the budget


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


class _GatherThenMatmul(nn.Module):
    """An expert-dispatch-like layer: an all-gather of per-rank counts inside the forward,
    and, only while autograd runs backward (recompute), one extra all-reduce the way FSDP's
    prefetch of a nested group adds one: the count of collectives differs between forward
    and recompute."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.prefetched = torch.ones(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            dist.all_reduce(self.prefetched)
        counts = torch.empty(dist.get_world_size(), dtype=torch.long)
        dist.all_gather_into_tensor(counts, torch.tensor([x.shape[0]]))
        scale = counts.sum().to(x.dtype)
        return torch.tanh(x @ self.weight.t()) * scale


def _uneven_collectives_rank(policy_name: str) -> int:
    g = torch.Generator().manual_seed(dist.get_rank())
    weights, x = [torch.randn(8, 8, generator=g) for _ in range(2)], torch.randn(4, 8, generator=g)

    def run(wrap: bool) -> list[torch.Tensor]:
        layers = [_GatherThenMatmul(w.clone()) for w in weights]
        if wrap:
            for layer in layers:
                policy = (
                    BudgetPolicy(1 << 20)
                    if policy_name == "budget"
                    else ActivationPolicy.build(save=["matmul"])
                )
                checkpoint_wrapper(layer, policy)
        grads: list[torch.Tensor] = []
        for _ in range(2):  # the budget policy plans on the first call, saves on the second
            h = x.clone().requires_grad_()
            for layer in layers:
                h = layer(h)
            h.pow(2).sum().backward()
            grads += [
                layer.weight.grad.clone() for layer in layers if layer.weight.grad is not None
            ]
            for layer in layers:
                layer.weight.grad = None
        return grads

    plain, wrapped = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped, strict=True))
    return len(wrapped)


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy_name", ["selective", "budget"])
def test_collectives_that_differ_between_forward_and_recompute(policy_name: str) -> None:
    """Collectives bypass torch's per-op call count (which would otherwise fail in backward:
    "invocation index 1 ... not found in storage"); gradients stay bit-equal."""
    assert run_on_ranks(2, _uneven_collectives_rank, policy_name, timeout=120) == [4, 4]


class _SumInPlace(torch.autograd.Function):
    """Megatron's ``g`` without a copy: the all-reduce writes into its input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _RowParallelInPlace(_RowParallelMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.gelu(x @ self.up.t()) @ self.down.t()
        out: torch.Tensor = _SumInPlace.apply(partial)  # type: ignore[no-untyped-call]
        return out


def _in_place_rank() -> str:
    g = torch.Generator().manual_seed(0)
    layer = _RowParallelInPlace(torch.randn(16, 8, generator=g), torch.randn(8, 16, generator=g))
    checkpoint_wrapper(layer, ActivationPolicy.build(save=["matmul"]))
    try:
        layer(torch.randn(4, 8, generator=g, requires_grad=True))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_collective_writing_into_a_saved_output_is_refused() -> None:
    """An in-place all-reduce of a saved matmul output would be applied twice (the cache
    holds the reduced tensor, recompute reduces it again): refused in forward, named."""
    messages = run_on_ranks(2, _in_place_rank, timeout=120)
    for message in messages:
        assert "_RowParallelInPlace: collective c10d.allreduce_.default reduces in place" in message
        assert "saved for recompute ((4, 8), torch.float32)" in message
