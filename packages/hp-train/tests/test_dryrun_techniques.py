"""The dry run models every axis and technique of the runtime: expert and context parallelism,
checkpointing policies, offload, FP8 all-gathers, the pipeline's schedule from hp-mpmd, the
trainer's refused pairs, the search over the new axes and the paper reproduction."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hp_layout import Topology
from hp_mpmd.simulate import simulate
from hp_planner.price import DryRun, PricingError, StepShape, dry_run, fsdp_groups, search
from hp_planner.price.devices import device_for
from hp_planner.price.memory import GIB
from hp_planner.price.reproduce import reproduce_paper
from hp_planner.price.search import SearchSpace
from hp_train.config.combinations import REFUSALS
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig
from hp_train.dryrun import TrainerModel, cli
from hp_train.dryrun.cli import build_parser, main
from hp_train.parallel.pipeline import PIPELINE_SCHEDULES

MOE = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=64,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, every=2, n_shared_experts=1),
)
DEEP = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=64)
SHAPE = StepShape(global_batch=8, seq_len=64, optimizer="adamw")


def _run(parallel: ParallelConfig, shape: StepShape = SHAPE, model: ModelConfig = MOE) -> DryRun:
    return dry_run(TrainerModel(model), parallel, Topology.single_host(parallel.world_size), shape)


def test_expert_parallel_shards_experts_and_prices_the_all_to_alls() -> None:
    plain = _run(ParallelConfig(dp_shard=4))
    ep = _run(ParallelConfig(dp_shard=4, ep=2))
    groups = {g.name: g for g in ep.stages[0].groups}
    experts = groups["layers.1.ffn"]
    # Two of the four experts, over the dp_shard / ep = 2 ranks holding them; router and
    # shared experts (replicated over ep) in the tail.
    assert experts.local_shapes[:3] == ((2, 32, 64), (2, 64, 32), (2, 32, 64))
    assert experts.flat.shards == 2
    assert experts.tail_axis == "ep"
    assert not any(".ffn." in p.name for p in groups["layers.1"].params)
    # The same ranks hold a parameter's shards (now experts are split by ep first), but a
    # block gathers only its rank's experts.
    buffers, plain_buffers = dict(ep.memory.buffers), dict(plain.memory.buffers)
    assert buffers["block unsharded params"] < plain_buffers["block unsharded params"]
    tokens = 8 // 4 * 64
    a2a = tokens * 2 * 64 * 2  # tokens x top_k x dim, bf16
    counts = 2 * 4 * 8
    tail = (experts.flat.padded_numel - experts.extra_start) * 2
    assert ep.kind("ep").nbytes == 4 * a2a + counts + tail
    assert plain.kind("ep").calls == 0
    skewed = _run(ParallelConfig(dp_shard=4, ep=2), replace(SHAPE, expert_imbalance=1.5))
    assert skewed.kind("ep").nbytes == 4 * int(1.5 * tokens * 2) * 64 * 2 + counts + tail
    assert skewed.time.compute > ep.time.compute  # the busiest rank computes 1.5x the rows


def test_context_parallel_ring_and_ulysses_volumes() -> None:
    base = _run(ParallelConfig(dp_shard=2))
    ring = _run(ParallelConfig(dp_shard=1, cp=2))
    uly = _run(ParallelConfig(dp_shard=1, cp=2, cp_variant="ulysses"))
    tokens = 8 * 64 // 2  # the whole batch per data-parallel rank, half of each sequence
    width = tokens * 4 * 16  # all heads after the kv expansion
    # Ring: one pass per block each way, both buffers counted, fp32 key/value blocks.
    assert ring.kind("cp").nbytes == 2 * 2 * (2 * width * 4) * 2
    # Ulysses: q/k/v stack and output, forward and backward, bf16.
    assert uly.kind("cp").nbytes == 2 * 2 * (3 * width + width) * 2
    # FSDP shards over dp_shard x cp: the same chunks as two shards.
    assert ring.memory.parameters == base.memory.parameters
    # Ring keeps the visiting blocks and their scores; Ulysses the gathered q/k/v.
    assert ring.memory.activations > uly.memory.activations


def test_checkpointing_policies_trade_memory_for_recompute() -> None:
    runs = {
        ac: _run(ParallelConfig(dp_shard=2), replace(SHAPE, ac=ac), DEEP)
        for ac in ("none", "selective", "full", "budget:0.01", "budget:1000")
    }
    acts = {ac: r.memory.activations for ac, r in runs.items()}
    assert acts["none"] > acts["selective"] > acts["full"]
    assert acts["budget:1000"] == acts["none"]
    assert runs["full"].time.compute > runs["selective"].time.compute == runs["none"].time.compute
    assert runs["budget:0.01"].time.compute > runs["budget:1000"].time.compute
    # Every recomputing policy repeats the forward's tensor-parallel collectives.
    tp_none = _run(ParallelConfig(tp=2), replace(SHAPE, ac="none"), DEEP).kind("tp").calls
    tp_sel = _run(ParallelConfig(tp=2), replace(SHAPE, ac="selective"), DEEP).kind("tp").calls
    assert tp_sel > tp_none
    with pytest.raises(PricingError, match="budget:<MiB>"):
        StepShape(8, 64, ac="sometimes")


def test_the_trainers_refusals_are_the_dry_runs() -> None:
    cases = [
        (ParallelConfig(cp=2), replace(SHAPE, seq_len=66), "--seq-len"),
        (ParallelConfig(), replace(SHAPE, swap=True, ac="full"), "--ac full"),
    ]
    messages = [r.message() for r in REFUSALS]
    for parallel, shape, second in cases:
        with pytest.raises(PricingError) as info:
            _run(parallel, shape)
        assert str(info.value) in messages  # the trainer's own refusal, word for word
        assert second in str(info.value)
    # The modeled baselines are other runtimes: hp-train's refusals are not theirs.
    assert _run(ParallelConfig(tp=2), replace(SHAPE, fp8="tensorwise", runtime="torch_fsdp2"))


def test_pipeline_bubble_is_hp_mpmds_simulation() -> None:
    for schedule in ("1f1b", "gpipe"):
        shape = replace(SHAPE, microbatches=4, pp_schedule=schedule)
        run = _run(ParallelConfig(pp=4), shape, DEEP)
        slowest = max(run.stages, key=lambda s: s.microbatch_time)
        f = slowest.microbatch_forward
        sim = simulate(
            PIPELINE_SCHEDULES[schedule](4, 4),
            forward=f,
            backward=slowest.microbatch_time - f,
        )
        assert run.time.bubble == pytest.approx(sim.makespan - 4 * slowest.microbatch_time)
    gpipe = _run(ParallelConfig(pp=4), replace(SHAPE, microbatches=4, pp_schedule="gpipe"), DEEP)
    onefb = _run(ParallelConfig(pp=4), replace(SHAPE, microbatches=4), DEEP)
    # GPipe keeps every microbatch in flight on every stage, 1F1B min(pp - stage, m).
    assert gpipe.stages[0].memory.activations == onefb.stages[0].memory.activations
    assert gpipe.stages[-1].memory.activations > onefb.stages[-1].memory.activations


def test_offload_and_fp8_all_gather() -> None:
    plain = _run(ParallelConfig(dp_shard=2))
    both = _run(ParallelConfig(dp_shard=2), replace(SHAPE, offload="both"))
    assert both.memory.parameters == both.memory.gradients == both.memory.optimizer == 0
    assert both.memory.host == plain.memory.state
    assert both.time.offload > 0 == plain.time.offload
    fp8 = _run(ParallelConfig(dp_shard=2), replace(SHAPE, fp8_all_gather=True))
    ratio = fp8.kind("fsdp_all_gather").nbytes / plain.kind("fsdp_all_gather").nbytes
    assert ratio == pytest.approx((1 + 4 / 128) / 2, rel=1e-3)


def test_swap_moves_kept_activations_to_host_and_times_their_copies() -> None:
    """Swap keeps on the device only the small per-token tensors (and, under selective, the
    block input) plus two blocks fetched back in backward; the rest is in host memory, the
    copies' waits are offload time (not communication), and a slow host link exposes more."""
    parallel = ParallelConfig(dp_shard=2)
    for ac in ("none", "selective"):
        kept = _run(parallel, replace(SHAPE, ac=ac), DEEP)
        swap = _run(parallel, replace(SHAPE, ac=ac, swap=True), DEEP)
        blocks = sum(b for name, b in kept.memory.activations_by_layer if name != "head")
        on_device = sum(b for name, b in swap.memory.activations_by_layer if name != "head")
        assert swap.memory.swapped + on_device == blocks
        assert swap.memory.fetched == 2 * swap.memory.swapped // DEEP.n_layers
        assert swap.memory.saved_peak < kept.memory.saved_peak
        assert swap.memory.total < kept.memory.total
        # Collectives run on while compute waits for a copy: less of them is exposed.
        assert swap.time.exposed_comm <= kept.time.exposed_comm
        assert swap.time.offload > 0 == kept.time.offload
        assert swap.time.total >= kept.time.total
    slow_host = replace(device_for(Topology.single_host(2)), host_bandwidth=1e6)
    shape = replace(SHAPE, swap=True)
    fast = _run(parallel, shape, DEEP)
    slow = dry_run(TrainerModel(DEEP), parallel, Topology.single_host(2), shape, device=slow_host)
    assert slow.time.offload > 10 * fast.time.offload
    assert [n for n in fast.notes if "activation swap" in n]
    with pytest.raises(PricingError, match="--swap"):
        _run(parallel, replace(SHAPE, ac="full", swap=True), DEEP)


def test_baseline_runtimes() -> None:
    parallel = ParallelConfig(dp_replicate=2, dp_shard=2)
    hp = _run(parallel)
    fsdp2 = _run(parallel, replace(SHAPE, runtime="torch_fsdp2"))
    ddp = _run(parallel, replace(SHAPE, runtime="megatron_ddp"))
    assert fsdp2.time.fsdp_comm > hp.time.fsdp_comm  # the copies
    assert fsdp2.kind("hsdp_all_reduce").calls == hp.kind("hsdp_all_reduce").calls
    assert ddp.kind("fsdp_all_gather").calls == 0 < ddp.kind("ddp_all_reduce").calls
    assert ddp.memory.parameters == 4 * sum(
        g.flat.padded_numel for g in fsdp_groups(TrainerModel(MOE), 1, 1)
    )


def test_search_covers_the_new_axes_and_defaults_to_device_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    space = SearchSpace(microbatches=(1, 2), ac=("none", "full"))
    result = search(TrainerModel(MOE), Topology.single_host(4), SHAPE, 10**15, space=space)
    layouts = {(r.parallel.ep, r.parallel.cp, r.parallel.pp) for r in result.fitting}
    assert any(ep > 1 for ep, _, _ in layouts)
    assert any(cp > 1 for _, cp, _ in layouts)
    assert any(pp > 1 for _, _, pp in layouts)
    # ep carved from dp_shard x cp: both together, ep a multiple of cp.
    both = [r.parallel for r in result.fitting if r.parallel.ep > 1 and r.parallel.cp > 1]
    assert both
    assert all(p.ep % p.cp == 0 and (p.dp_shard * p.cp) % p.ep == 0 for p in both)
    assert result.refused or result.evaluated
    times = [r.time.total for r in result.fitting]
    assert times == sorted(times)
    assert main(["--model", "tiny-moe", "--topology", "single_host:4", "--search"]) == 0
    out = capsys.readouterr().out
    assert "fit in 80.0 GiB per rank" in out  # the accelerator preset's memory
    # Swap is tried with the policies that can swap, never with full recomputation.
    swapping = replace(space, ac=("none", "full"), swap=(False, True), pp=(1,), cp=(1,))
    tried = search(
        TrainerModel(MOE), Topology.single_host(4), SHAPE, 10**15, space=swapping
    ).fitting
    assert {(r.shape.ac, r.shape.swap) for r in tried} == {
        ("none", False),
        ("none", True),
        ("full", False),
    }


def test_cli_takes_the_trainers_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "tiny-moe", "--dp-shard", "4", "--ep", "2", "--ac", "budget:8"]
    assert main([*args, "--offload", "params"]) == 0
    assert "ac=budget:8" in capsys.readouterr().out
    args = ["--model", "tiny-moe", "--dp-shard", "4", "--ep", "2", "--ac", "full"]
    assert main([*args, "--offload", "params", "--fp8-all-gather"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+ep\s+\d+", out, re.M)
    assert "ac=full" in out
    assert main(["--model", "tiny", "--dp-shard", "2", "--ac", "selective"]) == 0
    assert "ac=selective" in capsys.readouterr().out
    assert main(["--model", "tiny", "--dp-shard", "1", "--cp", "2", "--cp-variant", "ulysses"]) == 0
    assert re.search(r"^\s+cp\s+\d+", capsys.readouterr().out, re.M)
    assert main(["--model", "tiny", "--dp-shard", "2", "--recompute"]) == 0
    assert "ac=full" in capsys.readouterr().out
    assert main(["--model", "tiny-moe", "--dp-shard", "2", "--ep", "4", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+ep\s+\d+", out, re.M)
    assert re.search(r"^\s+cp\s+\d+", out, re.M)
    # ep takes whole context-parallel groups: a multiple of cp.
    assert main(["--model", "tiny-moe", "--dp-shard", "4", "--ep", "2", "--cp", "4"]) == 2
    assert "ep=2 with cp=4 must be a multiple of cp" in capsys.readouterr().err
    assert "no runtime support" not in build_parser().format_help()


# The layouts of the README's reproduction that come out best under each runtime (hp-fsdp:
# replicate 2 x ep 128; FSDP2: shard 768 x ep 64; Megatron DDP: ep 32 x pp 8, 8 microbatches)
# and their neighbours: the whole report in seconds instead of the full search's minute.
SMALL_REPRODUCTION = SearchSpace(
    dp_replicate=(1, 2),
    tp=(1,),
    ep=(32, 64, 128),
    cp=(1,),
    pp=(1, 8),
    ep_tp=(False,),
    microbatches=(1, 8),
    ac=("full",),
)


def test_reproduce_paper_prints_the_papers_figures_beside_the_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        cli,
        "reproduce_paper",
        lambda model, step, **kw: reproduce_paper(model, step, space=SMALL_REPRODUCTION, **kw),
    )
    assert main(["--reproduce-paper"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"GiB per rank \(searched in \d+ s\)", out)
    for figure in ("421k", "2.9%", "29.7%", "25.5%"):
        assert f"paper {figure:>7}" in out
    rows = re.findall(r"^  (\S.*?)\s+paper\s+\S+\s+predicted\s+(\S+)\s+\(([+-]\d+)%\)$", out, re.M)
    assert len(rows) == 4
    lines = out.splitlines()
    for name, _, deviation in rows:
        i = next(k for k, line in enumerate(lines) if line.startswith(f"  {name}"))
        explained = i + 1 < len(lines) and lines[i + 1].startswith("    why: ")
        assert explained == (abs(int(deviation)) > 20), name
    assert re.search(r"#1 .*GiB/rank, step .*k tokens/s, FSDP comm", out)
    assert "#1 dp_replicate=1 dp_shard=768 ep=32 microbatches=1 ac=full: 29.8 GiB/rank" in out
    best = float(re.search(r"#1 .*?: ([\d.]+) GiB/rank", out).group(1))  # type: ignore[union-attr]
    assert best <= 64
    assert "source: device ascend_910c_die" in out
    assert GIB
