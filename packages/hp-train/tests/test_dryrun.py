"""Tests of the dry-run planner: arithmetic against meta tensors and hp_layout, scale, errors."""

from __future__ import annotations

import re
import time

import pytest
import torch

from hp_layout import Topology, plan_flat_buffer
from hp_muon import split_params
from hp_planner.price import (
    PricingError,
    StepShape,
    dry_run,
    fsdp_groups,
    muon_traffic,
    parameter_count,
    search,
    topology_preset,
)
from hp_planner.price.muon_traffic import job_muon_step, planned_traffic
from hp_planner.price.structure import job_plan
from hp_train.config.presets import MODEL_PRESETS, MOE_505B_PARAMS, model_preset
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.dryrun import PREDICTED_KINDS, TrainerModel, predict_for_run
from hp_train.dryrun.cli import main
from hp_train.model.llama import Transformer
from hp_train.optim import ROUTER_PATTERNS

MOE_TINY = ModelConfig(n_layers=4, moe=MoEConfig(n_experts=4, top_k=2, n_shared_experts=1))
TRAIN = TrainConfig(global_batch=8, seq_len=32)


def _meta_groups(model: ModelConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Parameters by fully_shard group (blocks, then the root), from the meta model."""
    with torch.device("meta"):
        module = Transformer(model)
    blocks: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    root: list[tuple[str, tuple[int, ...]]] = []
    for name, p in module.named_parameters():
        found = re.match(r"layers\.(\d+)\.", name)
        target = blocks.setdefault(int(found.group(1)), []) if found else root
        target.append((name, tuple(p.shape)))
    return [blocks[i] for i in sorted(blocks)] + [root]


@pytest.mark.parametrize("model", [ModelConfig(), MOE_TINY])
def test_state_memory_equals_meta_tensor_sizes(model: ModelConfig) -> None:
    with torch.device("meta"):
        module = Transformer(model)
    split = split_params(module, adamw_patterns=ROUTER_PATTERNS)  # as build_optimizer
    muon = sum(p.numel() for p in split.muon_params)
    adamw = sum(p.numel() for p in split.adamw_params)
    pred = predict_for_run(model, ParallelConfig(), TRAIN)
    assert pred.param_elements == muon + adamw == parameter_count(TrainerModel(model))
    assert pred.muon_state_bytes == 4 * muon
    assert pred.adamw_state_bytes == 2 * 4 * adamw + 4 * len(split.adamw_params)
    assert pred.optimizer_state_bytes == pred.muon_state_bytes + pred.adamw_state_bytes
    padded = sum(
        plan_flat_buffer([s for _, s in g], 1, 4).padded_numel for g in _meta_groups(model)
    )
    assert pred.param_bytes == pred.grad_bytes == 4 * padded
    adam_only = predict_for_run(model, ParallelConfig(), replace_optimizer(TRAIN, "adamw"))
    assert adam_only.muon_state_bytes == 0
    n_params = len(split.muon_params) + len(split.adamw_params)
    assert adam_only.adamw_state_bytes == 8 * (muon + adamw) + 4 * n_params


def replace_optimizer(train: TrainConfig, optimizer: str) -> TrainConfig:
    return TrainConfig(global_batch=train.global_batch, seq_len=train.seq_len, optimizer=optimizer)


@pytest.mark.parametrize(("replicate", "shard"), [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("model", [ModelConfig(), MOE_TINY])
def test_fsdp_bytes_equal_flat_buffer_layouts(
    model: ModelConfig, replicate: int, shard: int
) -> None:
    parallel = ParallelConfig(replicate, shard, 1, 1)
    groups = [plan_flat_buffer([s for _, s in g], shard, 4) for g in _meta_groups(model)]
    blocks, root = groups[:-1], groups[-1]
    for rank in range(parallel.world_size):
        pred = predict_for_run(model, parallel, TRAIN, rank=rank)
        padded = sum(f.padded_numel for f in groups)
        gathered = padded + sum(f.padded_numel for f in blocks)  # blocks re-gather in backward
        assert pred.bytes_by_kind["fsdp_all_gather"] == 4 * gathered
        assert pred.calls_by_kind["fsdp_all_gather"] == len(groups) + len(blocks)
        assert pred.bytes_by_kind["fsdp_reduce_scatter"] == 4 * padded
        assert pred.calls_by_kind["fsdp_reduce_scatter"] == len(groups)
        chunks = sum(f.chunk_numel for f in groups)
        assert pred.param_bytes == pred.grad_bytes == 4 * chunks
        expected_ar = 4 * chunks if replicate > 1 else 0
        assert pred.bytes_by_kind["hsdp_all_reduce"] == expected_ar
        assert pred.bytes_by_kind["tp"] == 0
        assert set(pred.bytes_by_kind) == set(PREDICTED_KINDS)
        assert pred.muon_source == "plan"
        coordinate = rank % shard
        pieces = sum(sum(sp.stop - sp.start for sp in f.spans(coordinate)) for f in (*blocks, root))
        assert pred.param_elements == pieces
    del root


def test_muon_bytes_from_real_plan_match_analytic_average() -> None:
    model = MODEL_PRESETS["tiny"].model
    parallel = ParallelConfig(2, 2, 1, 1)
    groups = fsdp_groups(TrainerModel(model), 2, 1)
    plan = job_plan(TrainerModel(model), parallel, ranks=frozenset(range(4)), muon=True)
    exact = [planned_traffic(job_muon_step(plan, r, 32.0), r, 2) for r in range(4)]
    analytic = muon_traffic(groups, parallel, exact=False)
    average = sum(t.sent_bytes for t in exact) / 4
    assert exact[0].source == "plan"
    assert analytic.source == "analytic"
    assert analytic.sent_bytes == pytest.approx(average, rel=0.12)
    pred = predict_for_run(model, parallel, TRAIN, rank=1)
    assert pred.sent_bytes_by_kind["muon"] == exact[1].sent_bytes


def test_tensor_parallel_shards_and_costs() -> None:
    model = ModelConfig()
    pred = predict_for_run(model, ParallelConfig(1, 2, 2, 1), TRAIN)
    whole = predict_for_run(model, ParallelConfig(1, 2, 1, 1), TRAIN)
    assert pred.bytes_by_kind["tp"] > 0
    assert pred.param_elements < whole.param_elements
    tokens = TRAIN.global_batch // 2 * TRAIN.seq_len
    act = tokens * model.dim * 4
    # 4 all-reduces per block, 2 for the embedding, the logits' all-gather, the norms' tail.
    floor = (4 * model.n_layers + 2) * act + tokens * model.vocab_size * 4
    assert pred.bytes_by_kind["tp"] > floor


def test_505b_preset_counts_and_runs_at_768_ranks_fast() -> None:
    preset = model_preset("moe_505b")
    assert parameter_count(TrainerModel(preset.model)) == MOE_505B_PARAMS == 505_256_113_152
    start = time.perf_counter()
    run = dry_run(
        TrainerModel(preset.model),
        ParallelConfig(1, 768, 1, 1),
        topology_preset("ascend_supernode"),
        StepShape(preset.global_batch, preset.seq_len, microbatches=2, ac="full"),
        model_name="moe_505b",
    )
    assert time.perf_counter() - start < 30
    assert run.memory.parameters == pytest.approx(MOE_505B_PARAMS * 4 / 768, rel=0.01)
    assert 0 < run.time.fsdp_exposed_fraction <= run.time.fsdp_fraction
    assert run.stages[0].muon.source == "analytic"
    assert run.kind("fsdp_all_gather").by_tier[0][0] == "supernode"


def test_search_returns_fitting_configs_sorted_by_time() -> None:
    preset = model_preset("llama_8b")
    topo = topology_preset("cluster:2x4")
    shape = StepShape(16, 2048)
    everything = search(TrainerModel(preset.model), topo, shape, 10**15, microbatch_options=(1, 2))
    totals = sorted(r.memory.total for r in everything.fitting)
    limit = totals[len(totals) // 2]
    result = search(TrainerModel(preset.model), topo, shape, limit, microbatch_options=(1, 2))
    assert result.fitting
    assert result.rejected
    assert len(result.fitting) + result.rejected == result.evaluated == everything.evaluated
    assert all(r.memory.total <= limit for r in result.fitting)
    times = [r.time.total for r in result.fitting]
    assert times == sorted(times)
    assert any(r.parallel.pp > 1 for r in everything.fitting)


def test_pipeline_is_modeled_with_bubble_and_note() -> None:
    preset = model_preset("llama_8b")
    run = dry_run(
        TrainerModel(preset.model),
        ParallelConfig(1, 2, 1, 4),
        Topology.single_host(8),
        StepShape(16, 1024, microbatches=4),
    )
    mb = max(s.microbatch_time for s in run.stages)
    assert run.time.bubble == pytest.approx(3 * mb)
    assert any("pp > 1" in n for n in run.notes)
    assert run.kind("pp").calls > 0
    assert len(run.stages) == 4


def test_bad_input_gives_clear_errors() -> None:
    tiny = ModelConfig()
    priced = TrainerModel(tiny)
    with pytest.raises(PricingError, match="multiply to the topology's world size"):
        dry_run(priced, ParallelConfig(1, 3, 1, 1), Topology.single_host(4), StepShape(12, 32))
    with pytest.raises(PricingError, match="tp=3 must divide n_heads=4"):
        dry_run(priced, ParallelConfig(1, 1, 3, 1), Topology.single_host(3), StepShape(3, 32))
    with pytest.raises(PricingError, match="not divisible by the data-parallel degree"):
        dry_run(priced, ParallelConfig(1, 3, 1, 1), Topology.single_host(3), StepShape(8, 32))
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'"):
        model_preset("gpt5")
    with pytest.raises(PricingError, match="unknown topology preset"):
        topology_preset("torus:4")
    with pytest.raises(PricingError, match="pipeline"):
        predict_for_run(tiny, ParallelConfig(1, 1, 1, 2), TRAIN)


def test_cli_prints_report_and_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny", "--dp-shard", "2", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "fsdp_all_gather" in out
    assert "FSDP communication" in out
    assert "layers.0" in out
    assert main(["--model", "tiny", "--topology", "single_host:4", "--search", "--top", "2"]) == 0
    assert "#1 " in capsys.readouterr().out
    assert main(["--model", "nope", "--dp-shard", "2"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["--model", "tiny", "--topology", "single_host:4", "--dp-shard", "3"]) == 2
    assert "world size" in capsys.readouterr().err
