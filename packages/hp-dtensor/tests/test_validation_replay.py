"""Validation mode's op-by-op replay: the first op whose local result differs from what
production mode would compute raises PlanMismatchError naming the op and the module.

Every case here gets past the boundary checks: the DTensor rules redistribute where the plan
falls short, so with the replay switched off each of these runs completes without an error
(tried by planting that in validation.py). Only the replay of each op on the unredistributed
local tensors -- what production mode runs -- notices. Together the cases cover the replay's
outcomes: another local shape, other local values, an error.

Two cases plant a rule (``register_sharding_rule``) that is exact for DTensors but needs a
collective production mode does not run; the real rule is put back afterwards, even when the
run fails. Each rank function then runs the same model again with the real rules, in the same
worker, so the restoration is checked too (the rank pool's workers outlive a test).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_dtensor import DeviceMesh, OpCall, ShardingDecision, _dispatch, register_sharding_rule
from hp_dtensor.parallel import (
    ParallelStyle,
    PlanMismatchError,
    RowwiseParallel,
    parallelize_module,
    transformer_tp_plan,
)
from hp_dtensor.rules import rule_for
from hp_dtensor.rules._common import with_placements
from hp_layout import Layout, Mesh, Partial, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
BATCH, SEQ = 2, 6

Rule = Callable[[OpCall], ShardingDecision]


@contextlib.contextmanager
def planted_rule(rule: Rule, *funcs: Any) -> Iterator[None]:
    """Register ``rule`` for ``funcs`` for the duration; put the real rules back on exit.

    The dispatcher caches decisions per (op, layouts) for the life of the process, so the cache
    is emptied on entry (an earlier test's decision would bypass the planted rule) and on exit
    (the planted decision must not outlive the plant).
    """
    real = {func: rule_for(func) for func in funcs}
    missing = [func for func, found in real.items() if found is None]
    assert not missing, f"no real rule to restore for {missing}"
    register_sharding_rule(*funcs)(rule)
    _dispatch._PREPARED.clear()
    try:
        yield
    finally:
        for func, found in real.items():
            assert found is not None
            register_sharding_rule(func)(found)
        _dispatch._PREPARED.clear()


def gathering_silu(call: OpCall) -> ShardingDecision:
    """A wrong rule for silu: it claims a Replicate output, so it gathers its input first.

    Right for DTensors (silu of the whole tensor is replicated; the following ``mul`` slices
    it back), but production mode runs silu on its shard and gets a shard-shaped result.
    """
    (layout,) = call.layouts
    whole = with_placements(layout, [Replicate()] * layout.mesh.ndim)
    return ShardingDecision((whole,), whole)


def split_mean(call: OpCall) -> ShardingDecision:
    """A wrong rule for ``mean`` over the last dim (keepdim) of a replicated tensor on a 1-d
    mesh, the only way the test model calls it (RMSNorm): it splits the reduction over the
    ranks (each averages its slice into a partial sum).

    Right for DTensors (the Partial is reduced by the next nonlinear op), but production mode
    averages the whole row it holds and gets other values.
    """
    (layout,) = call.layouts
    last = layout.ndim - 1
    count = layout.global_shape[last]
    sliced = with_placements(layout, [Shard(last)] * layout.mesh.ndim)
    shape = (*layout.global_shape[:last], 1)
    out = Layout(shape, layout.mesh, [Partial(ReduceOp.SUM)] * layout.mesh.ndim)

    def local_mean(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.sum(x, *args, **kwargs) / count

    return ShardingDecision((sliced,), out, local_func=local_mean)


def _forward(plan: dict[str, ParallelStyle]) -> str:
    """One validation-mode forward and backward of the test Llama; ``"passed"`` or the
    PlanMismatchError's message."""
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    torch.manual_seed(0)
    model = parallelize_module(Llama(CONFIG), mesh, plan, mode="validation")
    ids = torch.randint(
        0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    try:
        model(ids).sum().backward()
    except PlanMismatchError as exc:
        return str(exc)
    return "passed"


_PLANTS: dict[str, tuple[Rule, tuple[Any, ...]]] = {
    "silu": (gathering_silu, (F.silu,)),
    "mean": (split_mean, (torch.Tensor.mean,)),
}


def _with_plant(name: str) -> tuple[str, str]:
    """(message with the planted rule, outcome of the same model with the real rule)."""
    torch.set_num_threads(1)
    rule, funcs = _PLANTS[name]
    with planted_rule(rule, *funcs):
        planted = _forward(transformer_tp_plan())
    return planted, _forward(transformer_tp_plan())


def _with_plan(change: str) -> tuple[str, str]:
    """(message with a changed TP plan, outcome of the unchanged plan)."""
    torch.set_num_threads(1)
    plan = transformer_tp_plan()
    if change == "unsharded_up_projection":
        # w3 left replicated while w1 is column-parallel: in production silu(w1 x) is a shard
        # and w3 x is whole, and their product cannot broadcast.
        del plan["layers.*.ffn.w3"]
    elif change == "partial_gate_projection":
        # The gate projection row-parallel with its output left a partial sum: silu needs the
        # sum (the rule reduces it), production would apply silu to each rank's partial sum.
        plan["layers.*.ffn.w1"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Partial()
        )
    else:
        raise ValueError(change)
    return _forward(plan), _forward(transformer_tp_plan())


@pytest.mark.multiprocess
def test_a_rule_claiming_the_wrong_output_layout_is_named_with_the_shapes() -> None:
    for planted, real in run_on_ranks(2, _with_plant, "silu", timeout=300):
        assert planted.startswith("op 'silu' in module 'layers.0.ffn' with input layouts"), planted
        assert (
            f"local result of shape {(BATCH, SEQ, CONFIG.ffn_dim)}, production mode would "
            f"compute shape {(BATCH, SEQ, CONFIG.ffn_dim // 2)}"
        ) in planted, planted
        assert "input 0 had to be redistributed" in planted, planted
        assert real == "passed", real


@pytest.mark.multiprocess
def test_a_rule_splitting_a_reduction_is_named_with_other_values() -> None:
    for planted, real in run_on_ranks(2, _with_plant, "mean", timeout=300):
        # RMSNorm's mean of x^2, the first op of the first block on the whole hidden state.
        assert planted.startswith("op 'mean' in module 'layers.0.attn_norm'"), planted
        assert "production mode would compute other local values" in planted, planted
        assert "input 0 had to be redistributed" in planted, planted
        assert real == "passed", real


@pytest.mark.multiprocess
def test_a_local_op_that_would_fail_in_production_is_named() -> None:
    for changed, real in run_on_ranks(2, _with_plan, "unsharded_up_projection", timeout=300):
        assert changed.startswith("op 'mul' in module 'layers.0.ffn'"), changed
        assert "production mode would run it on local tensors and fail with RuntimeError" in (
            changed
        ), changed
        assert "input 1 had to be redistributed" in changed, changed
        assert real == "passed", real


@pytest.mark.multiprocess
def test_a_partial_input_of_a_nonlinear_op_is_named() -> None:
    # (A Partial added to a replicated residual is not a good case: the rule partitions the
    # residual by keeping it on one rank, so only the other ranks' values differ, and the rank
    # that does not raise blocks in its next collective. Every case here differs on every rank.)
    for changed, real in run_on_ranks(2, _with_plan, "partial_gate_projection", timeout=300):
        assert changed.startswith("op 'silu' in module 'layers.0.ffn'"), changed
        assert "input layouts [Layout([2, 6, 24], {tp: Partial('sum')})]" in changed, changed
        assert "production mode would compute other local values" in changed, changed
        assert "input 0 had to be redistributed" in changed, changed
        assert real == "passed", real


def test_planted_rule_is_restored_after_a_failure() -> None:
    real = rule_for(F.silu)
    seen: list[object] = []

    def fail_under_the_plant() -> None:
        with planted_rule(gathering_silu, F.silu):
            seen.append(rule_for(F.silu))
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        fail_under_the_plant()
    assert seen == [gathering_silu]
    assert rule_for(F.silu) is real
    assert not _dispatch._PREPARED  # no decision of the planted rule is left cached
