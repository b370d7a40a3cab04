"""The pricing's cost model against formulas written here, not read from its helpers, on
models nobody here wrote (Hugging Face's Llama and Qwen3-MoE, ``hf_priced``; a Llama with
hp-testing's MoE layer, ``test_price_search``) and on :class:`~hp_planner.price.TransformerDims`.

* collectives: the alpha-beta ring time and the bytes a rank sends per collective kind, on the
  tier found by listing every group of the documented rank layout (row-major over ``pp,
  dp_replicate, expert_shard, ep, cp, tp``, tp innermost) on a three-tier topology whose host
  size (6) makes some groups of a degree straddle hosts where the first does not;
* compute: the FLOPs model of :mod:`hp_planner.price.workload` (dense and MoE blocks, the
  head, backward twice the forward, full recomputation once more, an expert-parallel rank's
  imbalance, expert-tensor parallelism);
* tensor parallelism: Megatron's activation collectives of one microbatch per block, the
  embedding and the head, in bf16, repeated by recomputation;
* memory: the two moments of backward, each buffer FSDP holds (bf16 all-gathers, the fp32
  reduce-scatter copy, the FP8 wire), the kept activations per token, by hand;
* the pipeline's closed forms (uniform stages: ``(m + p - 1)(f + b)``, GPipe's sends twice
  per stage boundary, 1F1B keeping ``min(p - s, m)`` microbatches in flight);
* FP8 all-gather records and host-offload transfers.
"""

from __future__ import annotations

import itertools
import math

import pytest

from hf_priced import HFPriced, llama_config, qwen3_moe_config
from hp_layout import Collective, Tier, Topology
from hp_planner import JobDims, PlanInputError
from hp_planner.price import (
    BF16_MIXED,
    Device,
    MoEDims,
    PricedModel,
    PricingError,
    RankGrid,
    StepShape,
    TransformerDims,
    TransformerShape,
    dry_run,
    pipeline_timing,
    precision_of,
)
from hp_planner.price.comm import ring_sent_bytes
from hp_planner.price.memory import fp8_record_bytes
from hp_planner.price.schedule import in_flight
from hp_planner.price.workload import (
    attention_forward_flops,
    block_forward_flops,
    head_forward_flops,
)
from test_price_search import LlamaWithExperts

# Fast to slow; the host (6 ranks) is not a power of two, so a tp group of 4 can straddle two.
THREE_TIERS = Topology(
    (
        Tier("board", 2, 400e9, 1e-6),
        Tier("host", 6, 100e9, 5e-6),
        Tier("pod", 24, 12.5e9, 20e-6),
    ),
    name="three-tier",
)
LAYOUT = ("pp", "dp_replicate", "expert_shard", "ep", "cp", "tp")
# Each communication group as the mesh axes it spans (the module doc of hp_planner.price.comm).
GROUP_AXES = {
    "pp": ("pp",),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("expert_shard", "ep", "cp"),
    "dp": ("dp_replicate", "expert_shard", "ep", "cp"),
    "expert_dp": ("dp_replicate", "expert_shard"),
    "expert_shard": ("expert_shard",),
    "ep": ("ep",),
    "cp": ("cp",),
    "tp": ("tp",),
}
GRIDS = [
    JobDims(dp_shard=6, tp=4),
    JobDims(dp_replicate=2, dp_shard=3, tp=2, pp=2),
    JobDims(dp_shard=6, tp=2, cp=2, ep=6),
    JobDims(dp_shard=3, cp=2, ep=2, tp=4),
    JobDims(dp_replicate=3, dp_shard=4, ep=2, tp=2),
    JobDims(dp_shard=4, cp=3, tp=2),
    JobDims(dp_replicate=4, dp_shard=3, pp=2),
]
DEVICE = Device("test", peak_flops=1e14, efficiency=0.5, host_bandwidth=1e10)


def _sizes(parallel: JobDims) -> dict[str, int]:
    """The layout's axis sizes: ``ep`` is carved from the shard axis ``dp_shard x cp``,
    innermost, so with ``cp > 1`` it takes whole cp groups: its own axis holds ``ep / cp``."""
    p = parallel
    carved = p.ep > 1 and p.cp > 1
    return {
        "pp": p.pp,
        "dp_replicate": p.dp_replicate,
        "expert_shard": p.dp_shard * p.cp // p.ep if carved else p.dp_shard // p.ep,
        "ep": p.ep // p.cp if carved else p.ep,
        "cp": p.cp,
        "tp": p.tp,
    }


def _group_axes(parallel: JobDims) -> dict[str, tuple[str, ...]]:
    """:data:`GROUP_AXES`, an expert-parallel group spanning the cp axis it is carved over."""
    if parallel.ep > 1 and parallel.cp > 1:
        return {**GROUP_AXES, "ep": ("ep", "cp")}
    return GROUP_AXES


def _groups(parallel: JobDims, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group spanning ``axes``: ranks that agree on every other axis."""
    sizes = _sizes(parallel)
    groups: dict[tuple[int, ...], list[int]] = {}
    for coords in itertools.product(*(range(sizes[a]) for a in LAYOUT)):
        rank = 0
        for axis, c in zip(LAYOUT, coords, strict=True):
            rank = rank * sizes[axis] + c
        key = tuple(c for axis, c in zip(LAYOUT, coords, strict=True) if axis not in axes)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def _slowest_tier(topology: Topology, groups: list[list[int]]) -> Tier:
    """The fastest tier one of whose blocks holds each group whole."""
    for tier in topology.tiers:
        if all(len({r // tier.size for r in g}) == 1 for g in groups):
            return tier
    raise AssertionError("the last tier spans the world")


def _alpha_beta(kind: Collective, p: int, nbytes: float, tier: Tier) -> float:
    """Ring time: ``p - 1`` steps of one latency and ``1 / p`` of the buffer each; an all-reduce
    is a reduce-scatter then an all-gather; a send is one message."""
    if kind is Collective.SEND_RECV:
        return tier.latency + nbytes / tier.bandwidth
    step = (p - 1) * tier.latency + (p - 1) / p * nbytes / tier.bandwidth
    return 2 * step if kind is Collective.ALL_REDUCE else step


def _sent(kind: Collective, p: int, nbytes: float) -> float:
    if kind is Collective.SEND_RECV:
        return nbytes
    return (2 if kind is Collective.ALL_REDUCE else 1) * (p - 1) / p * nbytes


def _grid_id(p: JobDims) -> str:
    return f"r{p.dp_replicate}s{p.dp_shard}tp{p.tp}pp{p.pp}cp{p.cp}ep{p.ep}"


@pytest.mark.parametrize("parallel", GRIDS, ids=_grid_id)
def test_collectives_are_alpha_beta_rings_on_the_slowest_tier_of_any_group(
    parallel: JobDims,
) -> None:
    grid = RankGrid.build(parallel, THREE_TIERS)
    nbytes = 3_000_017
    kinds = [k for k in Collective if k is not Collective.BROADCAST]  # the pricing's kinds
    for name, axes in _group_axes(parallel).items():
        groups = _groups(parallel, axes)
        size = len(groups[0])
        tier = _slowest_tier(THREE_TIERS, groups)
        assert grid.size(name) == size, name
        assert grid.tier(name) == tier, name
        for kind in kinds:
            record = grid.record("tp", kind, "forward", name, nbytes, calls=3)
            if size == 1 and kind is not Collective.SEND_RECV:
                assert record is None
                continue
            assert record is not None
            p = 2 if kind is Collective.SEND_RECV else size
            assert (record.group_size, record.tier, record.calls) == (p, tier.name, 3)
            assert record.time == pytest.approx(_alpha_beta(kind, p, nbytes, tier), rel=1e-12)
            assert record.sent_bytes == int(_sent(kind, p, nbytes))
            assert record.total_time == pytest.approx(3 * record.time, rel=1e-12)
    sizes = _sizes(parallel)
    for rank in (0, 7, 13, 23):
        coordinate = grid.coordinate(rank)
        rebuilt = 0
        for axis in LAYOUT:
            rebuilt = rebuilt * sizes[axis] + coordinate[axis]
        assert rebuilt == rank
        shard = coordinate["expert_shard"] * sizes["ep"] + coordinate["ep"]
        assert coordinate["dp_shard"] == shard
        assert coordinate["fsdp"] == shard * sizes["cp"] + coordinate["cp"]


def test_a_grid_must_span_the_topology() -> None:
    with pytest.raises(PricingError, match="has 24 ranks but") as info:
        RankGrid.build(JobDims(dp_shard=4), THREE_TIERS)
    assert isinstance(info.value, PlanInputError)


def test_precision_names_map_to_element_sizes() -> None:
    """fp32 master weights and optimizer state always; bf16 compute and all-gathers under
    ``bf16``; the gradient wire in ``grad_reduce_dtype``."""
    for mixed, reduce_dtype, compute, reduce in [
        ("fp32", "fp32", 4, 4),
        ("fp32", "bf16", 4, 2),
        ("bf16", "fp32", 2, 4),
        ("bf16", "bf16", 2, 2),
    ]:
        precision = precision_of(mixed, reduce_dtype)
        sizes = (precision.param, precision.compute, precision.reduce, precision.optimizer)
        assert sizes == (4, compute, reduce, 4), (mixed, reduce_dtype)
    with pytest.raises(PricingError, match="mixed_precision must be 'fp32' or 'bf16', got 'fp16'"):
        precision_of("fp16")


def test_ring_sent_bytes() -> None:
    for p in (2, 3, 8):
        assert ring_sent_bytes(Collective.ALL_REDUCE, p, 1200.0) == pytest.approx(
            2400.0 * (p - 1) / p
        )
        assert ring_sent_bytes(Collective.ALL_GATHER, p, 1200.0) == pytest.approx(
            1200.0 * (p - 1) / p
        )
        assert ring_sent_bytes(Collective.REDUCE_SCATTER, p, 1200.0) == pytest.approx(
            1200.0 * (p - 1) / p
        )
        assert ring_sent_bytes(Collective.SEND_RECV, p, 1200.0) == 1200.0
    assert ring_sent_bytes(Collective.ALL_REDUCE, 1, 1200.0) == 0.0


# --- compute ----------------------------------------------------------------------------------

LLAMA = HFPriced(llama_config(num_hidden_layers=3))
QWEN = HFPriced(qwen3_moe_config())
EXPERTS = LlamaWithExperts(llama_config(num_hidden_layers=2))


def _block_flops(
    shape: TransformerShape,
    index: int,
    tp: int,
    seq: int,
    imbalance: float = 1.0,
    ep_tp: bool = False,
) -> float:
    """Forward FLOPs per token of one block on one of ``tp`` ranks: 2 per multiply-add."""
    d, q = shape.dim, shape.n_heads * shape.head_dim
    kv = shape.n_kv_heads * shape.head_dim
    projections = 2 * d * (q + kv + kv + q) / tp
    scores = 2 * 2 * seq * q / 2 / tp  # q.k and p.v over every pair, halved by the causal mask
    moe = shape.moe
    if moe is not None and moe.is_moe_layer(index):
        router = 2 * d * moe.n_experts
        expert = 3 * 2 * d * moe.expert_ffn_dim  # w1, w3, w2 (gate, up, down)
        routed = moe.top_k * imbalance * expert / (tp if ep_tp else 1)
        ffn = router + routed + moe.n_shared_experts * expert
    else:
        ffn = 3 * 2 * d * shape.ffn_dim / tp
    return projections + scores + ffn


DIMS = TransformerDims(
    vocab_size=1000, dim=96, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=24, ffn_dim=160
)
MOE_DIMS = TransformerDims(
    vocab_size=1000,
    dim=96,
    n_layers=4,
    n_heads=6,
    n_kv_heads=3,
    head_dim=20,
    ffn_dim=160,
    moe=MoEDims(n_experts=8, top_k=3, expert_ffn_dim=40, n_shared_experts=2, every=2),
)


@pytest.mark.parametrize("shape", [DIMS, MOE_DIMS], ids=["dense", "moe"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_flops_per_token_are_the_documented_model(shape: TransformerDims, tp: int) -> None:
    for index, seq, imbalance, ep_tp in itertools.product(
        range(shape.n_layers), (1, 128, 4096), (1.0, 1.75), (False, True)
    ):
        got = block_forward_flops(shape, index, tp, seq, ep_tp=ep_tp, expert_imbalance=imbalance)
        assert got == pytest.approx(_block_flops(shape, index, tp, seq, imbalance, ep_tp))
    d, q = shape.dim, shape.n_heads * shape.head_dim
    kv = shape.n_kv_heads * shape.head_dim
    for seq in (1, 4096):
        attention = (4 * d * q + 4 * d * kv) / tp + 2 * seq * q / tp
        assert attention_forward_flops(shape, tp, seq) == pytest.approx(attention)
    assert head_forward_flops(shape, tp) == pytest.approx(2 * d * shape.vocab_size / tp)


@pytest.mark.parametrize(
    ("model", "parallel", "ac", "imbalance"),
    [
        (LLAMA, JobDims(dp_shard=2, tp=2), "none", 1.0),
        (LLAMA, JobDims(dp_shard=2, tp=2), "full", 1.0),
        (LLAMA, JobDims(dp_shard=2, tp=2), "selective", 1.0),
        (QWEN, JobDims(dp_shard=2, tp=2), "full", 1.0),
        (EXPERTS, JobDims(dp_shard=4, ep=2), "none", 1.5),
        (EXPERTS, JobDims(dp_shard=2, tp=2, ep=2, ep_tp=True), "full", 1.5),
    ],
    ids=[
        "llama-none",
        "llama-full",
        "llama-selective",
        "qwen3moe-tp2-full",
        "experts-ep2-skewed",
        "experts-ep-tp-skewed",
    ],
)
def test_compute_time_is_the_flops_model(
    model: PricedModel, parallel: JobDims, ac: str, imbalance: float
) -> None:
    shape = StepShape(8, 32, microbatches=2, ac=ac, optimizer="adamw", expert_imbalance=imbalance)
    run = dry_run(model, parallel, Topology.single_host(4), shape, device=DEVICE)
    dims = model.shape
    tokens = 8 // parallel.dp // 2 * 32
    skew = imbalance if parallel.ep > 1 else 1.0
    blocks = sum(
        _block_flops(dims, i, parallel.tp, 32, skew, parallel.ep_tp) for i in range(dims.n_layers)
    )
    head = 2 * dims.dim * dims.vocab_size / parallel.tp
    redo = blocks if ac == "full" else 0.0  # selective keeps every matmul output
    flops = tokens * (3 * (blocks + head) + redo)
    assert run.time.compute == pytest.approx(2 * flops / (1e14 * 0.5), rel=1e-12)


def test_tensor_parallel_bytes_are_megatrons_activation_collectives() -> None:
    """Per microbatch: each block all-reduces its attention and feed-forward outputs forward
    and their input gradients backward; the vocabulary-parallel embedding adds one all-reduce
    of the activation forward and one backward, the head an all-gather of the logits; full
    recomputation repeats the blocks' forward ones. Each FSDP group all-reduces the gradients
    of its norms' weights (replicated over tp) before its reduce-scatter."""
    parallel = JobDims(dp_shard=2, tp=2)
    dims = LLAMA.shape
    for ac, repeats in (("none", 0), ("full", 1)):
        shape = StepShape(8, 32, microbatches=2, ac=ac)  # bf16 compute
        run = dry_run(LLAMA, parallel, Topology.single_host(4), shape, device=DEVICE)
        tokens = 8 // 2 // 2 * 32
        act = tokens * dims.dim * 2
        reduces = dims.n_layers * (2 + 2 + 2 * repeats) + 2
        logits = tokens * dims.vocab_size * 2
        norms = (dims.n_layers * 2 + 1) * dims.dim * 2  # two per block, the final one
        tails = dims.n_layers + 1
        expected = 2 * (reduces * act + logits + norms)
        tp = run.kind("tp")
        assert tp.nbytes == expected
        assert tp.calls == 2 * (reduces + 1 + tails)
        # A ring all-reduce over 2 ranks sends its buffer once, an all-gather half of it.
        assert tp.sent_bytes == 2 * (reduces * act + logits // 2 + norms)


# --- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ac", ["none", "full"])
def test_memory_is_the_larger_moment_of_backward(ac: str) -> None:
    """bf16 compute with fp32 master weights, AdamW, FSDP over 2 ranks, prefetch and FP8
    all-gathers: every term of the module doc of :mod:`hp_planner.price.memory` by hand, from
    the groups' flat layouts."""
    shape = StepShape(8, 32, ac=ac, optimizer="adamw", fp8_all_gather=True)
    run = dry_run(LLAMA, JobDims(dp_shard=2), Topology.single_host(2), shape, device=DEVICE)
    memory = run.memory
    groups = run.stages[0].groups
    assert shape.precision == BF16_MIXED
    chunks = sum(g.flat.chunk_numel for g in groups)
    root = next(g for g in groups if g.is_root).flat.padded_numel
    block = max(g.flat.padded_numel for g in groups if not g.is_root)
    pieces = sum(sum(g.local_numels(0)) for g in groups)
    n_params = sum(len(g.params) for g in groups)
    optimizer = 2 * 4 * pieces + 4 * n_params  # two fp32 moments, a 4-byte step each
    wire = 4 * math.ceil(block / 4) + 4 * math.ceil(block / 128)
    gathered = root * 2 + 2 * block * 2 + 2 * wire  # root, this block and the next, FP8 wire
    reduced = root * 2 + 2 * block * 2 + block * 4  # their gradients and the fp32 copy
    dims = LLAMA.shape
    d, q, f = dims.dim, dims.n_heads * dims.head_dim, dims.ffn_dim
    tokens = 8 // 2 * 32
    # Per token: the norms' inputs, normalized inputs and outputs; q, the keys and values
    # expanded to every query head and the attention output; the SwiGLU's four hidden
    # activations; two reciprocal RMS (bf16); the fp32 log-sum-exp per head.
    full = tokens * ((6 * d + 4 * q + 4 * f + 2) * 2 + dims.n_heads * 4)
    block_input = tokens * d * 2
    kept = full if ac == "none" else block_input
    transient = 0 if ac == "none" else full - block_input
    head = tokens * ((3 * d + 1) * 2 + dims.vocab_size * 4 + 8) + 4
    activations = dims.n_layers * kept + head
    held = chunks * 4 + optimizer
    backward_start = held + activations + gathered + 2 * tokens * dims.vocab_size * 4
    first_reduce_scatter = (
        held + chunks * 4 + activations - head - kept + transient + gathered + reduced
    )
    assert memory.parameters == memory.gradients == chunks * 4
    assert memory.optimizer == optimizer
    assert memory.activations == activations + transient
    assert memory.buffer_total == gathered + reduced
    assert memory.phases == {
        "backward start": backward_start,
        "first reduce-scatter": first_reduce_scatter,
    }
    assert memory.total == max(backward_start, first_reduce_scatter)


def test_fp8_records_pad_to_words_and_carry_a_scale_per_128() -> None:
    for numel in range(0, 700):
        assert fp8_record_bytes(numel) == 4 * math.ceil(numel / 4) + 4 * math.ceil(numel / 128)
    shape = StepShape(8, 32, microbatches=2, optimizer="adamw", fp8_all_gather=True)
    run = dry_run(LLAMA, JobDims(dp_shard=2), Topology.single_host(2), shape)
    records = 0
    for g in run.stages[0].groups:
        chunk = g.flat.chunk_numel
        record = 4 * math.ceil(chunk / 4) + 4 * math.ceil(chunk / 128)
        records += (1 if g.is_root else 2) * 2 * record  # blocks gather again in backward
    assert run.kind("fsdp_all_gather").nbytes == 2 * records


def test_offload_moves_chunks_over_the_host_link() -> None:
    """``params``: each group's fp32 chunk in before each of its all-gathers (the root's once,
    a block's twice) and its reduced gradient out, per microbatch; ``optimizer``: the state in
    and out once per step."""
    parallel = JobDims(dp_shard=2)
    params = dry_run(
        LLAMA,
        parallel,
        Topology.single_host(2),
        StepShape(8, 32, microbatches=2, optimizer="adamw", offload="params"),
        device=DEVICE,
    )
    moved = sum(
        g.flat.chunk_numel * ((1 if g.is_root else 2) * 4 + 4) for g in params.stages[0].groups
    )
    assert params.time.offload == pytest.approx(2 * moved / 1e10, rel=1e-12)
    optimizer = dry_run(
        LLAMA,
        parallel,
        Topology.single_host(2),
        StepShape(8, 32, optimizer="adamw", offload="optimizer"),
        device=DEVICE,
    )
    assert optimizer.memory.optimizer == 0 < optimizer.memory.host
    assert optimizer.time.offload == pytest.approx(2 * optimizer.memory.host / 1e10, rel=1e-12)


def test_without_prefetch_every_all_gather_is_exposed() -> None:
    """Without prefetching each all-gather is waited for as it is issued: all of its time is
    exposed, the blocks' as much as the root's, and in backward also what it waits on its tier
    for a reduce-scatter held in flight ahead of it (at most all reduce-scatters' time)."""
    shape = StepShape(8, 32, optimizer="adamw", prefetch=False)
    run = dry_run(LLAMA, JobDims(dp_shard=2), Topology.single_host(2), shape, device=DEVICE)
    gathers = run.kind("fsdp_all_gather")
    assert gathers.calls == 1 + 2 * LLAMA.shape.n_layers
    scatters = run.kind("fsdp_reduce_scatter")
    assert gathers.time * (1 - 1e-12) <= gathers.exposed
    assert gathers.exposed <= (gathers.time + scatters.time) * (1 + 1e-12)


# --- pipeline ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(3, 5), (4, 2), (2, 8)])
def test_pipeline_closed_forms(pp: int, m: int) -> None:
    f, b = 1.0, 2.5
    for schedule in ("1f1b", "gpipe"):
        timing = pipeline_timing(schedule, pp, m, f, b, 0.0)
        assert timing.makespan == pytest.approx((m + pp - 1) * (f + b))
        assert timing.bubble == pytest.approx((pp - 1) * (f + b))
        assert timing.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
        alive = [min(pp - s, m) if schedule == "1f1b" else m for s in range(pp)]
        assert list(timing.in_flight) == alive
        assert [in_flight(schedule, pp, m, s) for s in range(pp)] == alive
    # GPipe: the forward wave and the backward wave each cross every stage boundary once.
    gpipe = pipeline_timing("gpipe", pp, m, f, b, 0.25)
    assert gpipe.makespan == pytest.approx((m + pp - 1) * (f + b) + 2 * (pp - 1) * 0.25)
    assert in_flight("1f1b", 1, m, 0) == 1
    with pytest.raises(PricingError, match="needs pp > 1"):
        pipeline_timing("1f1b", 1, m, f, b, 0.0)


def test_dry_run_bubble_is_the_uniform_stage_formula() -> None:
    """Every stage timed at the slowest's microbatch: ``(p - 1)`` of its forward and backward."""
    model = HFPriced(llama_config(num_hidden_layers=6, num_key_value_heads=4))
    for schedule in ("1f1b", "gpipe"):
        shape = StepShape(8, 64, microbatches=4, optimizer="adamw", pp_schedule=schedule)
        run = dry_run(model, JobDims(pp=3), Topology.single_host(3), shape)
        assert [s.layers for s in run.stages] == [(0, 2), (2, 4), (4, 6)]
        slowest = max(s.microbatch_time for s in run.stages)
        assert run.time.bubble == pytest.approx(2 * slowest, rel=1e-9)


def test_accumulated_pipeline_steps_fill_and_drain_each_time() -> None:
    """``grad_accum`` pipeline steps of ``m`` microbatches: the same microbatches, compute and
    memory as one schedule of ``m x steps`` (1F1B keeps ``min(p - s, m)`` in flight either
    way), and one fill and drain per schedule: a bubble of ``steps (p - 1)`` slowest
    microbatches."""
    model = HFPriced(llama_config(num_hidden_layers=6, num_key_value_heads=4))
    topology = Topology.single_host(3)
    one = dry_run(model, JobDims(pp=3), topology, StepShape(12, 64, 6, optimizer="adamw"))
    both = StepShape(12, 64, 3, pipeline_steps=2, optimizer="adamw")
    accumulated = dry_run(model, JobDims(pp=3), topology, both)
    assert both.passes == 6
    assert both.microbatch_size(1) == 2
    assert accumulated.time.compute == one.time.compute
    assert [s.memory for s in accumulated.stages] == [s.memory for s in one.stages]
    slowest = max(s.microbatch_time for s in accumulated.stages)
    assert accumulated.time.bubble == pytest.approx(2 * 2 * slowest, rel=1e-9)
    assert one.time.bubble == pytest.approx(2 * slowest, rel=1e-9)
    with pytest.raises(PricingError, match="pipeline_steps"):
        StepShape(12, 64, 3, pipeline_steps=0)
