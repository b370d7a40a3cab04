"""What the pricing reads from the JobPlan, on models nobody in hp-planner wrote.

Hugging Face's ``LlamaForCausalLM`` and ``Qwen3MoeForCausalLM`` (``hf_priced.HFPriced``), and a
small Llama whose feed-forwards are hp-testing's MoE under expert parallelism (a
:class:`~hp_planner.price.MetaModel`). The oracles are written here or are the other libraries'
own:

* the FSDP groups (:func:`~hp_planner.price.fsdp_groups`): every trainable parameter of
  transformers' ``named_parameters`` in exactly one group, blocks in forward order (an MoE
  layer's expert group just before its block's), the local sizes of the Colwise/Rowwise rule
  (a formula), the buffer padded to whole chunks;
* :func:`~hp_planner.price.model_parameters` and ``parameter_count``: transformers' own
  ``named_parameters`` and ``num_parameters``;
* the tensor-parallel collectives: Megatron's two all-reduces a dense block each way;
* Muon (:mod:`hp_planner.price.muon_traffic`): the JobPlan's step, hp_muon's own
  ``plan_muon`` for another bucket size, buckets within the size, bytes sent by brute force
  over the plan's jobs;
* the pipeline (:func:`~hp_planner.price.pipeline_timing`): the closed-form makespan of GPipe
  and 1F1B and their microbatches in flight;
* the swap's fetch (:func:`~hp_planner.price.memory_breakdown`): two blocks' swapped
  activations, from the activation formula.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from hf_priced import HFPriced, llama_config, qwen3_moe_config
from hp_dtensor.parallel import ColwiseParallel, ExpertParallel, ParallelStyle, RowwiseParallel
from hp_muon import plan_muon
from hp_planner import JobDims, ModelParallelism, PlanInputError, TrainingPolicy
from hp_planner.price import (
    BF16_MIXED,
    GroupSpec,
    MetaModel,
    MoEDims,
    PricingError,
    StepShape,
    TransformerDims,
    fsdp_groups,
    job_plan,
    memory_breakdown,
    model_parameters,
    parameter_count,
    pipeline_timing,
)
from hp_planner.price.muon_traffic import job_muon_step, planned_traffic
from hp_planner.price.schedule import in_flight
from hp_planner.price.structure import tp_collectives
from hp_testing.llama import Llama, LlamaConfig
from hp_testing.moe import MoE

transformers = pytest.importorskip("transformers")

LLAMA = HFPriced(llama_config())
QWEN = HFPriced(qwen3_moe_config())
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROWWISE = ("o_proj", "down_proj")


def _hf_model(priced: HFPriced) -> Any:
    """transformers' own model of ``priced``'s config, on ``meta`` (a ``PreTrainedModel``)."""
    with torch.device("meta"):
        if priced.config.model_type == "qwen3_moe":
            return transformers.Qwen3MoeForCausalLM(priced.config)
        return transformers.LlamaForCausalLM(priced.config)


def _hf_shapes(priced: HFPriced) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in _hf_model(priced).named_parameters()}


def _local_shape(name: str, shape: tuple[int, ...], tp: int, moe: bool) -> tuple[int, ...]:
    """Megatron's rule under Hugging Face's names: a Colwise linear keeps ``1 / tp`` of its
    rows (dim 0), a Rowwise one of its columns (dim 1), the vocabulary-parallel embedding of
    its rows; norms, and an MoE block's feed-forward (kept whole), stay whole."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" else parts[-1]
    if tp == 1 or (moe and ".mlp." in name):
        return shape
    if leaf in COLWISE or leaf == "embed_tokens":
        return (shape[0] // tp, *shape[1:])
    if leaf in ROWWISE:
        return (shape[0], shape[1] // tp)
    return shape


# FSDP groups ---------------------------------------------------------------------------------


def _assert_packed(group: GroupSpec, dp_shard: int, numels: list[int]) -> None:
    """The buffer holds every local element, 16-byte (4 fp32 elements) aligned per parameter,
    padded to ``dp_shard`` equal chunks, and each chunk's pieces add up to the parameters."""
    flat = group.flat
    assert flat.padded_numel == dp_shard * flat.chunk_numel
    assert sum(numels) <= flat.padded_numel
    assert flat.padded_numel - sum(numels) < 4 * len(numels) + 4 * dp_shard
    per_param = [0] * len(numels)
    for c in range(dp_shard):
        for i, n in enumerate(group.local_numels(c)):
            per_param[i] += n
    assert per_param == numels


@pytest.mark.parametrize(("dp_shard", "tp"), [(1, 1), (2, 1), (4, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("priced", [LLAMA, QWEN], ids=["llama", "qwen3_moe"])
def test_every_parameter_in_one_group_in_forward_order_with_its_local_shape(
    priced: HFPriced, dp_shard: int, tp: int
) -> None:
    shapes = _hf_shapes(priced)
    moe = priced.shape.moe is not None
    groups = fsdp_groups(priced, dp_shard, tp)
    n = priced.config.num_hidden_layers
    assert [g.name for g in groups] == [f"model.layers.{i}" for i in range(n)] + ["root"]
    assert [g.block for g in groups] == [*range(n), None]
    assert [g.is_root for g in groups] == [False] * n + [True]
    assert not any(g.is_experts for g in groups)
    names = [p.name for g in groups for p in g.params]
    assert sorted(names) == sorted(shapes)  # each trainable parameter exactly once
    for g in groups:
        assert all(p.name.startswith(f"{g.name}.") for p in g.params) or g.is_root
        want = [_local_shape(p.name, shapes[p.name], tp, moe) for p in g.params]
        assert list(g.local_shapes) == want, g.name
        assert [p.shape for p in g.params] == [shapes[p.name] for p in g.params]
        _assert_packed(g, dp_shard, [math.prod(s) for s in want])
        # With tp > 1 the parameters replicated over tp form the buffer's tail (all-reduced
        # over tp before the reduce-scatter); without it there is no tail.
        slots = dict(zip((p.name for p in g.params), g.flat.slots, strict=True))
        whole = [p.name for p, s in zip(g.params, want, strict=True) if s == p.shape]
        split = [p.name for p in g.params if p.name not in whole]
        if tp == 1:
            assert g.extra_start == g.flat.padded_numel
        else:
            assert all(slots[name].offset >= g.extra_start for name in whole), g.name
            assert all(slots[name].offset < g.extra_start for name in split), g.name


def test_the_groups_of_a_pipeline_stage_are_its_blocks() -> None:
    """Stage ``k`` of 2 holds the blocks ``HFPriced`` cuts for it (two each); the first the
    embedding, the last the norm and head (each in its root group).

    (``HFPriced``'s later stages renumber their blocks from 0, as its ``nn.ModuleList`` cut
    does, so only the first stage's names are the whole model's.)"""
    shapes = _hf_shapes(LLAMA)
    first = fsdp_groups(LLAMA, 2, 1, pp=2, stage=0)
    last = fsdp_groups(LLAMA, 2, 1, pp=2, stage=1)
    assert [g.name for g in first] == ["model.layers.0", "model.layers.1", "root"]
    assert [g.is_root for g in last] == [False, False, True]
    assert [p.name for p in first[-1].params] == ["model.embed_tokens.weight"]
    assert sorted(p.name for p in last[-1].params) == ["lm_head.weight", "model.norm.weight"]
    block = [n for n in shapes if n.startswith("model.layers.0.")]
    for g in (*first[:-1], *last[:-1]):
        assert sorted(p.name[len(g.name) :] for p in g.params) == sorted(
            n[len("model.layers.0") :] for n in block
        )
    count = sum(p.numel for g in (*first, *last) for p in g.params)
    assert count == sum(math.prod(s) for s in shapes.values())


def test_parameters_are_transformers_own() -> None:
    for priced in (LLAMA, QWEN):
        hf = _hf_model(priced)
        params = model_parameters(priced)
        assert [(p.name, p.shape) for p in params] == [
            (n, tuple(p.shape)) for n, p in hf.named_parameters()
        ]
        assert (
            parameter_count(priced)
            == hf.num_parameters()
            == sum(p.numel() for p in hf.parameters())
        )
        # The tensor-parallel dim of the rule; matrices on Muon, vectors on AdamW.
        for p in params:
            moe = priced.shape.moe is not None
            local = _local_shape(p.name, p.shape, 2, moe)
            dims = [d for d, (a, b) in enumerate(zip(p.shape, local, strict=True)) if a != b]
            assert p.tp_dim == (dims[0] if dims else None), p.name
            if p.name.endswith(("q_proj.weight", "down_proj")):
                assert p.optimizer == "muon"
            if len(p.shape) == 1:
                assert p.optimizer == "adamw"


def test_tensor_parallel_collectives_per_block_embedding_and_head() -> None:
    """Megatron's: a dense block all-reduces after o_proj and down_proj forward and at the
    Colwise inputs backward; an MoE block's feed-forward is whole (one each way); the
    vocabulary-parallel embedding all-reduces its output; the gathered head all-gathers
    forward and slices backward (no collective)."""
    ar = "all_reduce"
    for i in range(4):
        assert tp_collectives(LLAMA, f"model.layers.{i}") == ((ar, ar), (ar, ar))
    for i in range(2):
        assert tp_collectives(QWEN, f"model.layers.{i}") == ((ar,), (ar,))
    for priced in (LLAMA, QWEN):
        assert tp_collectives(priced, "lm_head") == (("all_gather",), ())
        assert tp_collectives(priced, "model.embed_tokens")[0] == (ar,)
        # hp-train's names are not this model's: nothing there.
        assert tp_collectives(priced, "layers.0") == ((), ())


# Expert groups (a MetaModel with hp-testing's MoE under expert parallelism) --------------------

MOE_CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=16)
N_EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 4, 2, 16, 16


def _moe_llama() -> nn.Module:
    with torch.device("meta"):
        model = Llama(MOE_CONFIG)
        for block in model.layers:
            block.ffn = MoE(MOE_CONFIG.dim, EXPERT_FFN, N_EXPERTS, TOP_K, shared_hidden=SHARED_FFN)
    return model


_ATTENTION_TP: dict[str, ParallelStyle] = {
    "layers.*.attn.q_proj": ColwiseParallel(),
    "layers.*.attn.k_proj": ColwiseParallel(),
    "layers.*.attn.v_proj": ColwiseParallel(),
    "layers.*.attn.o_proj": RowwiseParallel(),
}


def _moe_parallelism(dims: JobDims) -> ModelParallelism:
    experts = tuple(f"layers.{i}.ffn" for i in range(MOE_CONFIG.n_layers)) if dims.ep > 1 else ()
    return ModelParallelism.of(
        _ATTENTION_TP,
        fsdp_units=("layers.*",),
        expert_modules=experts,
        expert_style=ExpertParallel() if experts else None,
    )


MOE_MODEL = MetaModel(
    shape=TransformerDims(
        vocab_size=64,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=8,
        ffn_dim=48,
        moe=MoEDims(N_EXPERTS, TOP_K, EXPERT_FFN, n_shared_experts=1),
    ),
    build=_moe_llama,
    parallelism_for=_moe_parallelism,
    training=TrainingPolicy(adamw_patterns=("*.router.weight",)),
)


@pytest.mark.parametrize(("dp_shard", "ep"), [(4, 2), (4, 4), (2, 2)])
def test_expert_groups_come_each_before_its_block(dp_shard: int, ep: int) -> None:
    """``ep > 1``: each MoE layer's feed-forward is a group of its own just before its
    block's, over ``dp_shard / ep`` chunks, its experts ``E / ep`` local, its router and
    shared experts the tail (reduced over ep); every parameter still in one group."""
    shapes = {n: tuple(p.shape) for n, p in _moe_llama().named_parameters()}
    groups = fsdp_groups(MOE_MODEL, dp_shard, 1, ep=ep)
    want: list[str] = []
    for i in range(MOE_CONFIG.n_layers):
        want += [f"layers.{i}.ffn", f"layers.{i}"]
    assert [g.name for g in groups] == [*want, "root"]
    assert [g.block for g in groups] == [i for i in range(3) for _ in (0, 1)] + [None]
    assert [g.is_experts for g in groups] == [True, False] * 3 + [False]
    assert [g.tail_axis for g in groups] == ["ep", "tp"] * 3 + ["tp"]
    assert sorted(p.name for g in groups for p in g.params) == sorted(shapes)
    for g in groups:
        if not g.is_experts:
            _assert_packed(g, dp_shard, [math.prod(s) for s in g.local_shapes])
            continue
        local = {p.name: s for p, s in zip(g.params, g.local_shapes, strict=True)}
        stacks = [n for n in local if ".experts." in n]
        assert sorted(stacks) == sorted(f"{g.name}.experts.w{k}" for k in (1, 2, 3))
        for name in local:
            full = shapes[name]
            assert local[name] == ((full[0] // ep, *full[1:]) if name in stacks else full)
        _assert_packed(g, dp_shard // ep, [math.prod(s) for s in g.local_shapes])
        # The tail: the router and the shared experts, after the expert stacks.
        slots = dict(zip((p.name for p in g.params), g.flat.slots, strict=True))
        assert all(slots[n].offset < g.extra_start for n in stacks)
        assert all(slots[n].offset >= g.extra_start for n in local if n not in stacks)
        assert g.extra_start == sum(math.prod(local[n]) for n in stacks)


def test_without_expert_parallelism_the_moe_is_part_of_its_block() -> None:
    groups = fsdp_groups(MOE_MODEL, 4, 1)
    assert [g.name for g in groups] == ["layers.0", "layers.1", "layers.2", "root"]
    assert [g.block for g in groups] == [0, 1, 2, None]
    assert not any(g.is_experts for g in groups)


# Muon -----------------------------------------------------------------------------------------


def _bucket_numel(mb: float) -> int:
    """bf16 elements in ``mb`` MiB (hp_muon's ``bucket_cap_mb``)."""
    return int(mb * 2**20) // 2


def _box_numel(job: Any) -> int:
    return math.prod(hi - lo for lo, hi in job.box)


MUON_DIMS = [JobDims(dp_shard=4), JobDims(dp_replicate=2, dp_shard=2), JobDims(dp_shard=2, tp=2)]


@pytest.mark.parametrize("dims", MUON_DIMS, ids=repr)
def test_muon_step_is_the_jobplans_and_replanned_for_another_bucket(dims: JobDims) -> None:
    plan = job_plan(LLAMA, dims, ranks=frozenset(range(4)), muon=True)
    (stage,) = plan.stages
    for rank in range(4):
        step = stage.muon_plan(rank)
        assert step is not None
        assert job_muon_step(plan, rank, 32.0) == step
        assert all(g.local or g.bucket_numel == _bucket_numel(32.0) for g in step.groups)
        small = job_muon_step(plan, rank, 0.01)
        layouts = stage.layouts(rank)
        names = [n for g in step.groups for n in g.names]
        direct = plan_muon(
            [(n, layouts[n]) for n in names], bucket_cap_mb=0.01, group_ranks=range(4), rank=rank
        )
        assert small == direct != step
        # The buckets respect the size: consecutive matrices, at most 0.01 MiB of bf16
        # unless one matrix alone is larger, and no bucket could take its successor's first.
        limit = _bucket_numel(0.01)
        for group in small.groups:
            if group.local:
                continue
            assert group.bucket_numel == limit
            buckets = group.plan.buckets
            assert len(buckets) > 1
            assert [i for b in buckets for i in b] == list(range(len(group.plan.jobs)))
            sizes = [[_box_numel(group.plan.jobs[i]) for i in b] for b in buckets]
            for size, after in zip(sizes, [*sizes[1:], None], strict=True):
                assert len(size) == 1 or sum(size) <= limit
                if after is not None:
                    assert sum(size) + after[0] > limit


@pytest.mark.parametrize("dims", MUON_DIMS, ids=repr)
def test_muon_traffic_counts_the_gather_and_the_scatter(dims: JobDims) -> None:
    """Brute force over the plan's jobs: a matrix's pieces this rank holds go to its owner
    (gather), and the owner sends every other holder its piece back (scatter), in bf16."""
    plan = job_plan(LLAMA, dims, ranks=frozenset(range(4)), muon=True)
    block = dims.dp_shard * dims.tp
    for rank in range(4):
        for mb in (32.0, 0.01):
            step = job_muon_step(plan, rank, mb)
            gather = scatter = 0
            for group in step.groups:
                for job in group.plan.jobs:
                    if job.owner != rank:
                        gather += sum(p.numel for p in job.sources if p.rank == rank)
                    else:
                        scatter += sum(p.numel for p in job.targets if p.rank != rank)
            traffic = planned_traffic(step, rank, block)
            assert traffic.source == "plan"
            assert traffic.sent_bytes == 2 * (gather + scatter)
            assert 0 <= traffic.fast_bytes <= traffic.sent_bytes
            assert traffic.calls <= 2 * traffic.buckets
            assert traffic.matrices == sum(len(g.plan.jobs) for g in step.groups)
    # Under HSDP every replica holds every matrix: the scatter moves bytes on every rank.
    if dims.dp_replicate > 1:
        step = job_muon_step(plan, 0, 32.0)
        assert any(
            p.rank != job.owner for g in step.groups for job in g.plan.jobs for p in job.targets
        )


def test_a_jobplan_without_its_muon_step_is_refused() -> None:
    plan = job_plan(LLAMA, JobDims(dp_shard=2), ranks=frozenset(range(2)))
    with pytest.raises(PricingError, match="no Muon step for rank 0"):
        job_muon_step(plan, 0, 32.0)


# The pipeline ---------------------------------------------------------------------------------

FORWARD, BACKWARD = 1.0, 2.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 3), (4, 3), (4, 8)])
def test_pipeline_timing_of_each_schedule(schedule: str, pp: int, m: int) -> None:
    """Without transfer time both fill and drain the pipeline once: ``(m + pp - 1)(f + b)``,
    a bubble of ``(pp - 1)(f + b)``. GPipe keeps every microbatch in flight on every stage;
    1F1B at most ``pp - stage`` of them."""
    timing = pipeline_timing(schedule, pp, m, FORWARD, BACKWARD, 0.0)
    assert timing.schedule == schedule
    assert timing.makespan == pytest.approx((m + pp - 1) * (FORWARD + BACKWARD))
    assert timing.bubble == pytest.approx((pp - 1) * (FORWARD + BACKWARD))
    assert timing.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    if schedule == "gpipe":
        want = tuple(m for _ in range(pp))
    else:
        want = tuple(min(pp - s, m) for s in range(pp))
    assert timing.in_flight == want
    assert tuple(in_flight(schedule, pp, m, s) for s in range(pp)) == want


@pytest.mark.parametrize(("pp", "m"), [(2, 3), (4, 8)])
def test_gpipe_pays_each_transfer_once_each_way(pp: int, m: int) -> None:
    comm = 0.25
    timing = pipeline_timing("gpipe", pp, m, FORWARD, BACKWARD, comm)
    # Forward: the last microbatch reaches the last stage after pp - 1 hops; backward the
    # same back: (m + pp - 1)(f + b) + 2 (pp - 1) comm.
    want = (m + pp - 1) * (FORWARD + BACKWARD) + 2 * (pp - 1) * comm
    assert timing.makespan == pytest.approx(want)
    assert timing.bubble == pytest.approx(want - m * (FORWARD + BACKWARD))


def test_a_pipeline_of_one_stage_is_refused() -> None:
    with pytest.raises(PricingError, match="pp=1"):
        pipeline_timing("1f1b", 1, 4, FORWARD, BACKWARD, 0.0)
    with pytest.raises(PlanInputError, match="schedule"):
        pipeline_timing("zigzag", 2, 4, FORWARD, BACKWARD, 0.0)
    assert in_flight("1f1b", 1, 4, 0) == 1


# The swap's fetch -----------------------------------------------------------------------------

TOKENS = 64


def _llama_block_bytes(cb: int) -> tuple[int, int]:
    """A Llama block of ``LLAMA`` under ``none`` (tp 1, flash): every kept byte, and what a
    1 KiB swapper leaves on the device (the tensors below it), by the activation formula."""
    s = LLAMA.shape
    d, q, ffn, heads = s.dim, s.n_heads * s.head_dim, s.ffn_dim, s.n_heads
    per_token = (6 * d + 2 + 4 * q + 4 * ffn) * cb + heads * 4
    small = [TOKENS * cb, TOKENS * cb, TOKENS * heads * 4]  # two RMS vectors, the lse
    return TOKENS * per_token, sum(b for b in small if b < 1024)


def test_backward_fetches_two_swapped_blocks_back() -> None:
    """With swap each block keeps on the device only its small tensors; backward holds two
    blocks' swapped activations at once (the one in backward, the one prefetched): the
    saved-activation peak is what backward has not freed plus those two."""
    groups = fsdp_groups(LLAMA, 2, 1)
    parallel = JobDims(dp_shard=2)
    s = LLAMA.shape
    cb = BF16_MIXED.compute
    head = TOKENS * ((3 * s.dim + 1) * cb + s.vocab_size * 4 + 8) + 4
    full, small = _llama_block_bytes(cb)
    swapped = full - small
    assert 0 < small < swapped
    for in_flight_count in (1, 2):
        step = StepShape(global_batch=8, seq_len=16, ac="none", swap=True, precision=BF16_MIXED)
        mem = memory_breakdown(
            s,
            groups,
            step,
            shard_coordinates=(0, 0),
            parallel=parallel,
            microbatch_tokens=TOKENS,
            in_flight=in_flight_count,
        )
        blocks = [f"model.layers.{i}" for i in range(4)]
        assert mem.activations_by_layer == (*((b, small) for b in blocks), ("head", head))
        assert mem.fetched == 2 * swapped
        assert mem.swapped == in_flight_count * 4 * swapped
        kept = in_flight_count * (4 * small + head)
        assert mem.activations == kept
        assert mem.first_freed == head + small
        assert mem.saved_peak == kept - head - small + 2 * swapped
    bare = memory_breakdown(
        s,
        groups,
        StepShape(global_batch=8, seq_len=16, precision=BF16_MIXED),
        shard_coordinates=(0, 0),
        parallel=parallel,
        microbatch_tokens=TOKENS,
    )
    assert (bare.fetched, bare.swapped) == (0, 0)
    assert bare.activations_by_layer[0] == ("model.layers.0", full)
    assert bare.saved_peak == 4 * full + head
