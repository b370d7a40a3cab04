"""The pieces of the training entry point, without processes: configuration, data, schedule,
checkpoint discovery, the TP plan of MoE models, divergence detection, the command line."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from hp_train.checkpoint.dcp import latest_checkpoint
from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.data.documents import corpus_documents
from hp_train.data.loader import DataSpec, TrainData, build_data
from hp_train.data.tokenizer import ByteTokenizer
from hp_train.model.llama import Transformer, moe_feed_forward
from hp_train.observe.monitor import divergent_ranks, layer_of
from hp_train.optim import build_optimizer, build_schedule, lr_factor
from hp_train.parallel.parallelize import check_model_fits, tp_plan
from hp_train.trainer import check_vocabulary


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(dim=30, n_heads=4), "divisible by n_heads"),
        (lambda: ModelConfig(dim=36, n_heads=4), "must be even for rotary"),
        (lambda: ModelConfig(n_heads=4, n_kv_heads=3), "must divide n_heads"),
        (lambda: ModelConfig(n_layers=0), "n_layers must be a positive integer"),
        (lambda: MoEConfig(n_experts=2, top_k=3), "top_k=3 exceeds"),
        (lambda: ParallelConfig(tp=0), "tp must be a positive integer"),
        (lambda: TrainConfig(optimizer="sgd"), "'muon' or 'adamw'"),
        (lambda: TrainConfig(lr=float("nan")), "lr must be a finite number"),
        (lambda: ParallelConfig.fill(6, dp_replicate=1, tp=4, pp=1), "not divisible"),
    ],
)
def test_config_errors(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()  # type: ignore[operator]


def test_parallel_fill_and_batch_split() -> None:
    parallel = ParallelConfig.fill(8, dp_replicate=2, tp=2, pp=1)
    assert (parallel.dp_shard, parallel.dp, parallel.world_size) == (2, 4, 8)
    assert TrainConfig(global_batch=8).check_batch(parallel) == 2
    with pytest.raises(ConfigError, match="divisible by the data-parallel degree"):
        TrainConfig(global_batch=6).check_batch(parallel)


def test_model_must_split_tp_ways_and_pp_stages() -> None:
    with pytest.raises(ConfigError, match="tp=3 must divide n_heads=4"):
        check_model_fits(ModelConfig(), ParallelConfig(tp=3))
    check_model_fits(ModelConfig(n_layers=2), ParallelConfig(pp=2))
    with pytest.raises(ConfigError, match="pp=3 needs at least 3 blocks"):
        check_model_fits(ModelConfig(n_layers=2), ParallelConfig(pp=3))


def test_microbatches_need_a_pipeline_and_divide_the_rank_batch() -> None:
    with pytest.raises(ConfigError, match="needs pipeline parallelism"):
        TrainConfig(microbatches=2).check_batch(ParallelConfig())
    with pytest.raises(ConfigError, match="must divide the per-rank batch"):
        TrainConfig(global_batch=8, microbatches=3).check_batch(ParallelConfig(pp=2))
    assert TrainConfig(global_batch=8, microbatches=4).check_batch(ParallelConfig(pp=2)) == 8


def test_pipeline_stages_keep_global_names_and_balance_blocks() -> None:
    from hp_train.model.llama import Transformer
    from hp_train.parallel.parallelize import tp_plan
    from hp_train.parallel.pipeline import keep_stage, stage_boundaries

    config = ModelConfig(n_layers=5, moe=MoEConfig(every=2))
    bounds = stage_boundaries(config, 2)
    assert (bounds[0], bounds[-1], len(bounds)) == (0, 5, 3)
    names = []
    for stage in range(2):
        model = keep_stage(Transformer(config), stage, bounds)
        names.append({n for n, _ in model.named_parameters()})
        plan = tp_plan(config, model)
        assert ("tok_embeddings" in plan) == (stage == 0)
        assert ("output" in plan) == (stage == 1)
    whole = {n for n, _ in Transformer(config).named_parameters()}
    assert names[0] | names[1] == whole
    assert not names[0] & names[1]
    assert "layers.4.attn.q_proj.weight" in names[1]


def test_corpus_is_the_installed_packages_text() -> None:
    texts = corpus_documents().texts
    assert any("class Transformer" in text for text in texts)
    assert corpus_documents().texts == texts  # the same documents every time


@pytest.mark.parametrize("kind", ["corpus", "synthetic", "pydoc"])
def test_batches_depend_on_seed_and_step_only(kind: str) -> None:
    def data() -> TrainData:
        return build_data(DataSpec(source=kind), ByteTokenizer(), seq_len=16, seed=3)

    source = data()
    a, b = source.batch(5, 8, 0, 1), data().batch(5, 8, 0, 1)
    assert torch.equal(a.inputs, b.inputs)
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])  # next-token targets
    assert not torch.equal(a.inputs, source.batch(6, 8, 0, 1).inputs)
    halves = [source.batch(5, 8, r, 2).inputs for r in range(2)]
    assert torch.equal(torch.cat(halves), a.inputs)
    assert int(a.inputs.max()) < 256


def test_the_tokenizer_must_fit_the_model_vocabulary() -> None:
    with pytest.raises(ConfigError, match="has 256 tokens and the model's vocabulary only 100"):
        check_vocabulary(ModelConfig(vocab_size=100), ByteTokenizer())
    check_vocabulary(ModelConfig(vocab_size=256), ByteTokenizer())


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig(steps=12, warmup_steps=3, min_lr_ratio=0.1)
    factors = [lr_factor(s, config) for s in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert math.isclose(factors[-1], 0.1)


def test_schedule_resumes_at_the_same_lr() -> None:
    config = TrainConfig(steps=10, warmup_steps=2)
    model = Transformer(ModelConfig(n_layers=1))
    full = build_optimizer(model, config)
    schedule = build_schedule(full, config)
    for _ in range(4):
        full.step()
        schedule.step()
    fresh = build_optimizer(Transformer(ModelConfig(n_layers=1)), config)
    build_schedule(fresh, config, start_step=4)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in full.param_groups]


def test_muon_takes_matrices_and_experts_adamw_the_rest() -> None:
    model = Transformer(ModelConfig(n_layers=2, moe=MoEConfig(every=2)))
    optimizer = build_optimizer(model, TrainConfig())
    muon, adamw = optimizer.optimizers  # type: ignore[attr-defined]
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in muon_ids}
    assert "layers.1.ffn.experts.w1" in names  # an expert stack [E, ffn, dim]
    assert "layers.0.ffn.w1.weight" in names
    assert "layers.1.ffn.router.weight" not in names
    assert "tok_embeddings.weight" not in names
    assert "output.weight" not in names
    assert len(adamw.param_groups[0]["params"]) + len(muon_ids) == len(list(model.parameters()))


def test_tp_plan_leaves_moe_feed_forwards_whole() -> None:
    plan = tp_plan(ModelConfig(n_layers=4, moe=MoEConfig(every=2)))
    assert "layers.0.ffn.w1" in plan
    assert "layers.2.ffn.w1" in plan
    assert not any(k.startswith(("layers.1.ffn", "layers.3.ffn")) for k in plan)
    assert "layers.*.attn.q_proj" in plan


def test_moe_routes_every_token_and_balances_to_one() -> None:
    torch.manual_seed(0)
    moe = moe_feed_forward(8, MoEConfig(n_experts=4, top_k=4, expert_ffn_dim=8))
    x = torch.randn(2, 5, 8)
    out = moe(x)
    assert out.shape == x.shape
    assert moe.last_counts is not None
    assert moe.last_counts.tolist() == [10, 10, 10, 10]
    assert moe.last_aux_loss is not None
    # top_k == n_experts: every expert gets every token, so f_e = 1/E and the balance loss
    # is 1, times its weight.
    assert math.isclose(moe.last_aux_loss.item(), 0.01, rel_tol=1e-5)


def test_latest_checkpoint_skips_partial_and_incomplete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    for name in ("step_000003", "step_000006"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
    (tmp_path / "step_000009.partial").mkdir()
    (tmp_path / "step_000012").mkdir()  # no .metadata: not finished
    assert latest_checkpoint(tmp_path) == (6, tmp_path / "step_000006")


def test_divergent_ranks() -> None:
    assert divergent_ranks([2.0, 2.1, 1.9, 2.0], 0.5) == []
    (bad,) = divergent_ranks([2.0, 2.0, 9.0, 2.0], 0.5)
    assert bad.rank == 2
    assert "rank 2 diverges" in bad.message()
    assert [d.rank for d in divergent_ranks([2.0, float("nan")], 0.5)] == [1]
    assert layer_of("layers.3.attn.q_proj.weight") == "layers.3"
    assert layer_of("tok_embeddings.weight") == "tok_embeddings"


def test_command_line() -> None:
    model, parallel, config, options, _ = parse(
        ["--tp", "2", "--experts", "4", "--steps", "7", "--seq-len", "96", "--out", "x"], 4
    )
    assert (parallel.dp_shard, parallel.tp) == (2, 2)
    assert model.moe is not None
    assert model.moe.n_experts == 4
    assert model.max_seq_len == 96
    assert config.steps == 7
    assert options.out_dir == Path("x")
    with pytest.raises(ConfigError, match="not divisible"):
        parse(["--tp", "3"], 4)
