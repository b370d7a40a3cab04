"""The dry run predicts the layouts of the real run: it resolves the trainer's plan on a meta
model, shares the trainer's fits check and preset table, and prints the plan.

The multi-rank test lays a real model out as the trainer does (``build_layout``, the pipeline
stage's blocks, ``parallelize``: TP, then FSDP per block and root) for a grid of
configurations at world 2 and 4 (one ``run_on_ranks`` call per world size runs them all) and
holds every parameter's ``hp_dtensor.contract.layout_of`` on every rank equal to
:func:`hp_planner.price.predicted_layouts` for that rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.contract import layout_of
from hp_layout import Replicate, Shard
from hp_planner.price import (
    PricingError,
    StepShape,
    dry_run,
    fsdp_groups,
    model_parameters,
    planned_model,
    predicted_layouts,
    resolved_plan,
    topology_preset,
)
from hp_planner.price.structure import stage_layers
from hp_testing import run_on_ranks
from hp_train.config import cli as train_cli
from hp_train.config import presets
from hp_train.config.presets import MODEL_PRESETS
from hp_train.config.schema import (
    ConfigError,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from hp_train.dryrun import TrainerModel, predict_for_run
from hp_train.dryrun import cli as dryrun_cli
from hp_train.dryrun.cli import main
from hp_train.model.llama import Transformer
from hp_train.parallel.parallelize import build_layout, check_model_fits, parallelize
from hp_train.parallel.pipeline import keep_stage, stage_boundaries

TINY = MODEL_PRESETS["tiny"].model
TINY_MOE = MODEL_PRESETS["tiny-moe"].model
# Three uniform blocks: two stages take 1 and 2 (the trainer's balanced split), not the 2 and 1
# of an even chunking; grouped-query attention; sizes whose flat buffers split unevenly.
ODD = ModelConfig(vocab_size=250, dim=48, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=100)

# (name, model, (dp_replicate, dp_shard, tp, pp)) at each world size.
GRID: dict[int, list[tuple[str, ModelConfig, tuple[int, int, int, int]]]] = {
    2: [
        ("tp2", TINY, (1, 1, 2, 1)),
        ("fsdp2", ODD, (1, 2, 1, 1)),
        ("pp2", ODD, (1, 1, 1, 2)),
        ("moe-tp2", TINY_MOE, (1, 1, 2, 1)),
        ("moe-fsdp2", TINY_MOE, (1, 2, 1, 1)),
    ],
    4: [
        ("hsdp2x2", ODD, (2, 2, 1, 1)),
        ("fsdp2xtp2", ODD, (1, 2, 2, 1)),
        ("replicate2xtp2", TINY, (2, 1, 2, 1)),
        ("pp2xtp2", ODD, (1, 1, 2, 2)),
        ("pp2xfsdp2", ODD, (1, 2, 1, 2)),
        ("moe-fsdp2xtp2", TINY_MOE, (1, 2, 2, 1)),
        ("moe-pp2xtp2", TINY_MOE, (1, 1, 2, 2)),
    ],
}


def _real_layouts(model: ModelConfig, dims: tuple[int, int, int, int]) -> dict[str, Any]:
    """Lay ``model`` out as the trainer does and return this rank's layouts, by name."""
    parallel = ParallelConfig(*dims)
    layout = build_layout(parallel, "cpu")
    torch.manual_seed(0)
    module = Transformer(model)
    if layout.pipeline_mesh is not None:
        stage = layout.pipeline_mesh.mesh.coordinate(dist.get_rank())[0]
        keep_stage(module, stage, stage_boundaries(model, parallel.pp))
    parallelize(module, layout)
    return {name: layout_of(p) for name, p in module.named_parameters()}


def _compare_grid(world: int) -> tuple[int, list[str]]:
    """On this rank, for every configuration of ``GRID[world]``: the real layouts against the
    dry run's; returns the parameters compared and the disagreements."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    compared, problems = 0, []
    for name, model, dims in GRID[world]:
        real = _real_layouts(model, dims)
        predicted = predicted_layouts(TrainerModel(model), ParallelConfig(*dims), rank)
        if set(real) != set(predicted):
            problems.append(
                f"{name} rank {rank}: real parameters {sorted(real)} but predicted "
                f"{sorted(predicted)}"
            )
        for fqn in sorted(set(real) & set(predicted)):
            compared += 1
            if real[fqn] != predicted[fqn]:
                problems.append(
                    f"{name} rank {rank} {fqn}: real {real[fqn]!r}, predicted {predicted[fqn]!r}"
                )
        dist.barrier()
    return compared, problems


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_predicted_layouts_equal_the_real_runs(world: int) -> None:
    """TP, FSDP, HSDP, FSDP x TP, PP (alone, x TP, x FSDP) and MoE: every parameter's layout
    on every rank is the dry run's."""
    results = run_on_ranks(world, _compare_grid, world, timeout=300)
    problems = [p for _, found in results for p in found]
    assert not problems, "\n".join(problems[:20])
    expected = 0
    for _, model, dims in GRID[world]:
        parallel = ParallelConfig(*dims)
        expected += sum(
            len(predicted_layouts(TrainerModel(model), parallel, r))
            for r in range(parallel.world_size)
        )
    assert sum(n for n, _ in results) == expected > 0


def test_the_tensor_parallel_dims_are_the_resolved_plans() -> None:
    """Dense projections sharded as the trainer's plan says; MoE feed-forwards (router, experts,
    shared experts) replicated over ``tp``, as the trainer keeps them."""
    moe = ModelConfig(
        n_layers=2,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, n_shared_experts=1),
    )
    dims = {p.name: p.tp_dim for p in model_parameters(TrainerModel(moe))}
    assert dims["layers.0.attn.q_proj.weight"] == 0
    assert dims["layers.0.attn.o_proj.weight"] == 1
    assert dims["layers.0.ffn.w1.weight"] == 0
    assert dims["layers.0.ffn.w2.weight"] == 1
    assert dims["tok_embeddings.weight"] == 0
    assert dims["output.weight"] == 0
    ffn = [n for n in dims if n.startswith("layers.1.ffn.")]
    assert {n.split(".")[3] for n in ffn} == {"router", "experts", "shared"}
    assert all(dims[n] is None for n in ffn)
    plan = resolved_plan(TrainerModel(moe), ParallelConfig(1, 2, 2, 1))
    for p in plan.params:
        placement = p.layout.placement("tp")
        assert dims[p.fqn] == (placement.dim if isinstance(placement, Shard) else None)
        assert isinstance(placement, Shard | Replicate)
    # Replicated over tp: packed last in their block's flat buffer (an all-reduced tail).
    (block,) = (g for g in fsdp_groups(TrainerModel(moe), 2, 2) if g.name == "layers.1")
    order = [p.name for p in block.params]
    replicated = [n for n in order if dims[n] is None]
    assert order[-len(replicated) :] == replicated
    assert set(ffn) <= set(replicated)


def test_moe_feed_forwards_are_not_divided_by_tp() -> None:
    """An MoE block's compute and activations are the same at tp 1 and 2 in its feed-forward
    (whole on every rank), its tensor-parallel activation collectives only its attention's."""
    from hp_planner.price.structure import tp_collectives
    from hp_planner.price.workload import block_forward_flops

    model = TINY_MOE
    priced = TrainerModel(model)
    dense, moe = 0, 1
    assert tp_collectives(priced, f"layers.{dense}") == (("all_reduce",) * 2,) * 2
    assert tp_collectives(priced, f"layers.{moe}") == (("all_reduce",),) * 2
    assert tp_collectives(priced, "output") == (("all_gather",), ())
    d, seq = model.dim, 32
    attention = 2 * (2 * d * d + 2 * d * model.n_kv_heads * model.head_dim) + 2 * seq * d
    one, two = (block_forward_flops(model, moe, tp, seq) for tp in (1, 2))
    assert one - two == pytest.approx(attention / 2)


FFN_350 = ModelConfig(ffn_dim=350)


def test_trainer_and_dry_run_refuse_the_same_configs_with_one_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ffn_dim=350, tp=4``: the trainer's check and every entry of the dry run refuse it,
    with the trainer's message."""
    parallel = ParallelConfig(1, 1, 4, 1)
    with pytest.raises(ConfigError) as trainer:
        check_model_fits(FFN_350, parallel)
    message = str(trainer.value)
    assert "tp=4 must divide ffn_dim=350" in message
    refusals: list[Callable[[], object]] = [
        lambda: dry_run(
            TrainerModel(FFN_350), parallel, topology_preset("single_host:4"), StepShape(4, 32)
        ),
        lambda: predict_for_run(FFN_350, parallel, TrainConfig(global_batch=4, seq_len=32)),
        lambda: predicted_layouts(TrainerModel(FFN_350), parallel, 0),
        lambda: planned_model(TrainerModel(FFN_350), parallel, 0),
        lambda: fsdp_groups(TrainerModel(FFN_350), 1, 4),
    ]
    for refuse in refusals:
        with pytest.raises(PricingError) as dry:
            refuse()
        assert str(dry.value) == message
    for flags in ([], ["--print-plan"]):
        assert main(["--ffn-dim", "350", "--tp", "4", "--dp-shard", "1", *flags]) == 2
        assert capsys.readouterr().err == f"hp-dryrun: error: {message}\n"
    # What the trainer accepts, the dry run accepts.
    fine = ParallelConfig(1, 1, 2, 1)
    check_model_fits(FFN_350, fine)
    dry_run(TrainerModel(FFN_350), fine, topology_preset("single_host:2"), StepShape(4, 32))


def test_one_preset_table() -> None:
    """The trainer's ``--model`` and the dry run's choose from one table."""
    parser = dryrun_cli.build_parser()
    for name, preset in presets.MODEL_PRESETS.items():
        assert dryrun_cli._model(parser.parse_args(["--model", name]))[1] == preset.model
    configs = {n: p.model for n, p in presets.MODEL_PRESETS.items()}
    assert configs == train_cli.MODEL_PRESETS
    assert {"tiny", "small", "tiny-moe", "llama_8b", "moe_505b"} <= set(MODEL_PRESETS)
    for name, preset in MODEL_PRESETS.items():
        assert train_cli.parse(["--model", name], 1)[0] == preset.model


def test_print_plan_prints_the_resolved_plan_with_flat_slots(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``hp-dryrun --print-plan``: the resolved plan of the rank (its stage) with the FSDP
    slots and optimizer groups, and nothing else."""
    args = ["--model", "tiny-moe", "--dp-shard", "2", "--tp", "2", "--rank", "1"]
    assert main([*args, "--print-plan"]) == 0
    out = capsys.readouterr().out
    parallel = ParallelConfig(1, 2, 2, 1)
    assert planned_model(TrainerModel(TINY_MOE), parallel, 1).table(1) in out
    assert "fsdp_all_gather" not in out  # not the dry-run report
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("layers.")}
    assert "tp: Replicate()" in rows["layers.1.ffn.experts.w1"]
    assert "tp: Shard(0)" in rows["layers.1.attn.q_proj.weight"]
    assert "layers.1[" in rows["layers.1.ffn.experts.w1"]  # its flat slot
    plan = planned_model(TrainerModel(TINY_MOE), parallel, 1)
    assert all(p.flat is not None and p.optimizer_group for p in plan.params)
    # Under pp the rank's stage: the blocks the trainer gives it.
    pipelined = ["--pp", "2", "--dp-shard", "1", "--n-layers", "3", "--rank", "1"]
    assert main([*pipelined, "--print-plan"]) == 0
    out = capsys.readouterr().out
    start, stop = stage_layers(TrainerModel(ModelConfig(n_layers=3)), 2, 1)
    assert (start, stop) == (1, 3)
    assert "layers.0." not in out
    assert "layers.1.attn.q_proj.weight" in out
    assert "output.weight" in out


def test_print_plan_shows_expert_and_context_parallelism(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``hp-dryrun --print-plan --ep 2``: after the stage's plan, each MoE block's expert plan on
    the rank (``n_experts / ep`` whole experts of each stack); ``--cp 2``: the attention cores
    context parallelism replaces, one per block."""
    moe = TINY_MOE.moe
    assert moe is not None
    assert main(["--model", "tiny-moe", "--dp-shard", "2", "--ep", "2", "--print-plan"]) == 0
    out = capsys.readouterr().out
    moe_blocks = [i for i in range(TINY_MOE.n_layers) if (i + 1) % moe.every == 0]
    assert moe_blocks
    sections = out.split("\n\nexpert parallel: ")[1:]
    assert [s.split("\n", 1)[0] for s in sections] == [f"layers.{i}.ffn" for i in moe_blocks]
    local = f"{moe.n_experts // 2}x{TINY_MOE.dim}x{moe.expert_ffn_dim}"
    for section in sections:
        rows = {line.split()[0]: line.split() for line in section.splitlines() if line}
        assert rows["experts.w1"][1] == f"{moe.n_experts}x{TINY_MOE.dim}x{moe.expert_ffn_dim}"
        assert local in rows["experts.w1"]
    assert main(["--model", "tiny", "--dp-shard", "1", "--cp", "2", "--print-plan"]) == 0
    out = capsys.readouterr().out
    cores = ", ".join(f"layers.{i}.attn.core" for i in range(TINY.n_layers))
    assert f"context parallel (ring) over cp=2: {cores}" in out
