"""The per-layer norms of ``metrics.jsonl`` are those of the whole tensors at world 2 (FSDP,
TP, MoE with expert parallelism): parameters and updates against the full tensors of the
step's checkpoint and of the initial model computed in one process; gradients against
hp-fsdp's global gradient norm."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hp_testing import run_on_ranks
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.model.llama import Transformer
from hp_train.observe.metrics import read_metrics
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=16)
MOE_MODEL = ModelConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    ffn_dim=64,
    max_seq_len=16,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, every=1),
)
CONFIG = TrainConfig(
    steps=1,
    global_batch=4,
    seq_len=16,
    data="synthetic",
    log_every=1,
    checkpoint_every=1,
    warmup_steps=0,
    optimizer="adamw",
)


def _train(out: str, model: ModelConfig, dp_shard: int, tp: int, ep: int) -> None:
    runtime = init_runtime("cpu", threads=1)
    parallel = ParallelConfig(dp_shard=dp_shard, tp=tp, ep=ep)
    try:
        train(model, parallel, CONFIG, RunOptions(out_dir=Path(out), quiet=True), runtime)
    finally:
        torch.use_deterministic_algorithms(False)


def _layer(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _full_norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    squares: dict[str, float] = defaultdict(float)
    for name, t in tensors.items():
        squares[_layer(name)] += float(t.double().pow(2).sum())
    return {k: math.sqrt(v) for k, v in squares.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "dp_shard", "tp", "ep"),
    [(MODEL, 2, 1, 1), (MODEL, 1, 2, 1), (MOE_MODEL, 2, 1, 2)],
    ids=["fsdp2", "tp2", "moe-ep2"],
)
def test_layer_norms_are_the_whole_tensors(
    tmp_path: Path, model: ModelConfig, dp_shard: int, tp: int, ep: int
) -> None:
    out = tmp_path / "run"
    run_on_ranks(2, _train, str(out), model, dp_shard, tp, ep)
    (record,) = read_metrics(out / "metrics.jsonl")
    layers: dict[str, dict[str, Any]] = record["layers"]  # type: ignore[assignment]
    dcp_to_torch_save(out / "checkpoints" / "step_000001", tmp_path / "full.pt")
    after = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    torch.manual_seed(CONFIG.seed)  # the trainer's initialization, in one process
    before = dict(Transformer(model).named_parameters())
    params = _full_norms(after)
    updates = _full_norms({k: after[k] - before[k].detach() for k in after})
    assert set(layers) == set(params)
    for name, norms in layers.items():
        assert norms["param"] == pytest.approx(params[name], rel=1e-6), name
        assert norms["update"] == pytest.approx(updates[name], rel=1e-4, abs=1e-9), name
    grads = math.sqrt(sum(n["grad"] ** 2 for n in layers.values()))
    assert grads == pytest.approx(record["grad_norm"], rel=1e-6)
