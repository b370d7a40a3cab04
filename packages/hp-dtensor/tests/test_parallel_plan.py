"""The resolved :class:`ParallelPlan`: pure (a ``meta`` model, no process group), deterministic,
equal across ranks, what the executors apply (``layout_of`` every parameter), and its table's
collectives are the ones a production step runs."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh, layout_of
from hp_dtensor.contract import parallel_plan_of
from hp_dtensor.parallel import (
    Boundary,
    CausalAttention,
    ColwiseParallel,
    ContextParallel,
    ContextParallelPlan,
    ExpertParallel,
    ExpertParallelPlan,
    ExpertTensorParallel,
    GradReductionPlan,
    ParallelStyle,
    ParamFlatSlot,
    PlanError,
    RowwiseParallel,
    ShardingPlan,
    parallelize_module,
    resolve,
    transformer_tp_plan,
)
from hp_layout import Mesh, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig
from hp_testing.moe import MoE

CONFIG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
TP2 = Mesh((2,), ("tp",))
DP_TP = Mesh((2, 2), ("dp", "tp"))


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        return Llama(CONFIG)


def test_resolution_needs_no_process_group_and_no_storage() -> None:
    assert not dist.is_initialized()
    plan = resolve(_meta_llama(), DP_TP, transformer_tp_plan(), tp_axis="tp")
    q = plan.param("layers.0.attn.q_proj.weight")
    assert q.global_shape == (16, 16)
    assert q.dtype == "float32"
    assert q.layout.placements == (Replicate(), Shard(0))
    assert q.local_shape(rank=1) == (8, 16)
    assert q.style == "ColwiseParallel"
    assert q.reduction is not None
    # Sharded on tp, replicated on dp: only the data-parallel average (DDP) remains.
    assert q.reduction.axes == (("dp", ReduceOp.AVG),)
    o = plan.param("layers.1.attn.o_proj.weight")
    assert o.layout.placements == (Replicate(), Shard(1))
    assert o.local_shape(3) == (16, 8)
    norm = plan.param("layers.0.attn_norm.weight")
    assert norm.style is None
    assert norm.layout.placements == (Replicate(), Replicate())
    assert norm.reduction == GradReductionPlan((("dp", ReduceOp.AVG), ("tp", ReduceOp.SUM)))
    # Validation mode's DTensor loss is global: sums everywhere.
    validation = resolve(
        _meta_llama(), DP_TP, transformer_tp_plan(), tp_axis="tp", mode="validation"
    )
    assert validation.param("layers.0.attn_norm.weight").reduction == GradReductionPlan(
        (("dp", ReduceOp.SUM), ("tp", ReduceOp.SUM))
    )
    every = {n for n, _ in _meta_llama().named_parameters()}
    assert {p.fqn for p in plan.params} == every


def test_plans_are_frozen_deterministic_and_compare_by_value() -> None:
    first = resolve(_meta_llama(), TP2, transformer_tp_plan())
    second = resolve(_meta_llama(), TP2, transformer_tp_plan())
    assert first == second
    assert first is not second
    assert first.to_json() == second.to_json()
    assert json.loads(first.to_json())["params"][0]["fqn"] == "tok_embeddings.weight"
    assert first != resolve(_meta_llama(), TP2, transformer_tp_plan(sequence_parallel=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.tp_axis = "dp"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.params[0].fqn = "x"  # type: ignore[misc]
    assert not any(isinstance(v, torch.Tensor) for v in _walk(first))


def _walk(value: Any) -> list[Any]:
    """Every value reachable from the plan's dataclasses, tuples and mappings."""
    out = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            out += _walk(getattr(value, f.name))
    elif isinstance(value, tuple | list):
        for item in value:
            out += _walk(item)
    elif isinstance(value, dict):
        for item in value.values():
            out += _walk(item)
    return out


def test_the_table_shows_shapes_placements_local_shapes_and_collectives() -> None:
    plan = resolve(_meta_llama(), TP2, transformer_tp_plan())
    table = plan.table(rank=1)
    lines = table.splitlines()
    assert lines[0].startswith("ParallelPlan (production mode) on tp=2")
    row = next(line for line in lines if line.startswith("layers.0.ffn.w2.weight "))
    assert row.split()[1:5] == ["16x24", "tp:", "Shard(1)", "16x12"]
    # Two row-parallel outputs per block and the embedding's all-reduced forward, their
    # adjoints backward; the head's output gathered, its gradient sliced; the norms' sum over
    # tp rides on a backward all-reduce.
    assert plan.collectives_per_step() == {
        "all_reduce": 2 * (2 * CONFIG.n_layers + 1),
        "all_gather": 1,
    }
    assert "collectives per step: 1 all_gather, 10 all_reduce" in table
    assert "gradient reductions of their own: none; 1 kind(s): sum(tp)" in table


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(PlanError, match="several axes; say which is tp_axis"):
        resolve(_meta_llama(), DP_TP, transformer_tp_plan())
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        resolve(_meta_llama(), TP2, transformer_tp_plan()).param("nope")
    slot = ParamFlatSlot("", 0, 0, 1, 0, 1, 1, ("dp",))
    with pytest.raises(KeyError, match="not in the plan"):
        resolve(_meta_llama(), TP2, {}).with_flat_slots({"nope": slot})


def test_a_shared_parameter_placed_two_ways_is_refused() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    plan = resolve(Tied(), TP2, {"a": ColwiseParallel(), "b": ColwiseParallel()})
    assert plan.param("b.weight").fqn == "a.weight"
    assert plan.params[0].aliases == ("b.weight",)
    with pytest.raises(PlanError, match="shared with another module"):
        resolve(Tied(), TP2, {"a": ColwiseParallel(), "b": RowwiseParallel()})


# --- what runs -----------------------------------------------------------------------------

_COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "batch_isend_irecv",
)


def _count_step(model: nn.Module, *inputs: torch.Tensor) -> Counter[str]:
    """The collectives one forward and backward of ``model`` runs, by kind."""
    counted: Counter[str] = Counter()
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            kind = (
                "ring_shift"  # the only point-to-point use: a send and a receive per rank
                if name == "batch_isend_irecv"
                else name.removesuffix("_single")
                .removesuffix("_into_tensor")
                .removesuffix("_tensor")
            )
            counted[kind] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        model(*inputs).sum().backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counted


def _on_ranks(sequence_parallel: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", TP2)
    plan = transformer_tp_plan(sequence_parallel=sequence_parallel)
    predicted = resolve(_meta_llama(), mesh, plan)
    torch.manual_seed(0)
    model = parallelize_module(Llama(CONFIG), mesh, plan, mode="production")
    recorded = parallel_plan_of(model)
    layouts_match = all(layout_of(model.get_parameter(p.fqn)) == p.layout for p in predicted.params)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 6))
    model(ids).sum().backward()  # the first step plans the boundaries
    counted = _count_step(model, ids)
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, predicted.to_json())
    return {
        "recorded_equal": recorded == predicted,
        "layouts_match": layouts_match,
        "counted": dict(counted),
        "predicted": predicted.collectives_per_step(),
        "reductions": len(predicted.reduction_kinds()),
        "same_on_every_rank": len(set(texts)) == 1,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_the_applied_plan_is_the_resolved_one_and_runs_its_collectives(
    sequence_parallel: bool,
) -> None:
    for out in run_on_ranks(2, _on_ranks, sequence_parallel, timeout=120):
        assert out["recorded_equal"]
        assert out["layouts_match"]
        assert out["same_on_every_rank"]
        # One sum over tp for every replicated parameter (norms): under plain TP it rides on
        # a boundary all-reduce, under SP it is one all-reduce of its own.
        assert out["reductions"] == 1
        assert out["counted"] == out["predicted"], out


def test_expert_and_context_parallel_modules_carry_their_own_plans() -> None:
    with torch.device("meta"):
        moe = MoE(8, 12, num_experts=4, top_k=2)
    plan = resolve(moe, Mesh((2,), ("ep",)), {"": ExpertParallel()})
    module = plan.module("")
    assert module is not None
    assert isinstance(module.sharding, ExpertParallelPlan)
    assert (module.sharding.num_experts, module.sharding.top_k) == (4, 2)
    assert plan.param("experts.w1").layout.placements == (Shard(0),)
    assert plan.param("experts.w1").local_shape(1) == (2, 12, 8)
    assert plan.param("router.weight").reduction == GradReductionPlan((("ep", ReduceOp.SUM),))
    assert "4 experts, 2 per rank; top-2 routing; tokens dispatched and combined by all-to-all" in (
        plan.table()
    )
    attention = nn.Sequential(CausalAttention())
    for variant, how in (("ring", "key/value blocks"), ("ulysses", "all-to-all between")):
        cp = resolve(attention, Mesh((2,), ("cp",)), {"0": ContextParallel(variant=variant)})
        sharding = cp.modules[0].sharding
        assert isinstance(sharding, ContextParallelPlan)
        assert sharding.variant == variant
        assert sharding.balanced
        assert f"{variant}: {how}" in cp.table()
        assert "zigzag (load-balanced) sequence sharding of dim 2" in cp.table()


class _Attention(nn.Module):
    """Self-attention of one input through a context-parallel core."""

    def __init__(self) -> None:
        super().__init__()
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.core(x, x, x)
        return out


def _modules_on_ranks(case: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: nn.Module
    plan: dict[str, ParallelStyle | ShardingPlan]
    axes: dict[str, Any]
    if case == "ep":
        mesh = DeviceMesh("cpu", Mesh((2,), ("ep",)))
        model, plan, axes = MoE(8, 12, 4, 2), {"": ExpertParallel()}, {}
        x = torch.randn(6, 8, requires_grad=True)
    elif case == "ep_tp":
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("ep", "tp")))
        model, plan = MoE(8, 12, 4, 2), {"": ExpertTensorParallel()}
        axes = {"tp_axis": "ep", "dp_axes": ()}
        x = torch.randn(6, 8, requires_grad=True)
    else:
        mesh = DeviceMesh("cpu", Mesh((2,), ("cp",)))
        # Each rank's x is its own piece of the sequence (dim 2): the root says so.
        sequence = ShardingPlan(inputs=(Boundary(Shard(2)),), outputs=Boundary(Shard(2)))
        model, axes = _Attention(), {}
        plan = {"": sequence, "core": ContextParallel(variant=case)}
        x = torch.randn(1, 4, 4, 4, requires_grad=True)
    with torch.device("meta"):
        meta = MoE(8, 12, 4, 2) if case.startswith("ep") else _Attention()
    predicted = resolve(meta, mesh, plan, **axes)
    parallelize_module(model, mesh, plan, mode="production", **axes)
    model(x).sum().backward()
    return {"counted": dict(_count_step(model, x)), "predicted": predicted.collectives_per_step()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("case", "world"), [("ep", 2), ("ep_tp", 4), ("ring", 2), ("ulysses", 2)])
def test_expert_and_context_parallel_collectives_are_predicted(case: str, world: int) -> None:
    for out in run_on_ranks(world, _modules_on_ranks, case, timeout=120):
        assert out["counted"] == out["predicted"], out


def test_a_sharded_plan_leaves_the_reductions_to_the_sharder() -> None:
    plan = resolve(_meta_llama(), TP2, transformer_tp_plan(sequence_parallel=True))
    assert plan.reduction_collectives() == {"all_reduce": 1}
    slot = ParamFlatSlot("", 0, 0, 16, 0, 16, 8, ("dp",))
    sharded = plan.with_flat_slots({"norm.weight": slot})
    assert sharded.param("norm.weight").flat == slot
    assert sharded.reduction_collectives() == {}
    assert sharded.collectives_per_step() == sharded.boundary_collectives()
    assert "by the sharder (flat slots), in its own collectives, not counted here" in (
        sharded.table()
    )
