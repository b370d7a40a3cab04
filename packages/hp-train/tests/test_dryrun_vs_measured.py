"""The dry run's prediction against a real step on world 2 and 4 (issue 7: within 5%).

Bytes are counted by instrumenting the collectives (``hp_fsdp.counting.CountingMode`` records
every collective's kind, process group and bytes); memory by tensor bookkeeping (the CPU has
no allocator statistics): the nbytes of this rank's parameter pieces, gradients and optimizer
state tensors.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_fsdp.counting import CountingMode
from hp_testing import run_on_ranks
from hp_train.config import ModelConfig, ParallelConfig, TrainConfig
from hp_train.dryrun import predict_for_run
from hp_train.model import Transformer
from hp_train.optim import build_optimizer
from hp_train.parallelize import build_layout, parallelize

MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=32)
CONFIG = TrainConfig(global_batch=4, seq_len=32, data="synthetic")
TOLERANCE = 0.05


def _kind(call: Any, layout: Any) -> str:
    ranks = frozenset(call.ranks)
    if call.purpose == "grad_reduce_scatter":
        # On gloo hp-fsdp carries it as an all-to-all (hp_fsdp._collectives): same bytes.
        return "fsdp_reduce_scatter"
    if call.kind == "all_to_all":
        return "muon"
    mesh = layout.mesh.mesh
    me = dist.get_rank()
    if ranks == frozenset(mesh.group_of(me, "tp")) and len(ranks) > 1:
        return "tp"
    if call.kind == "all_gather":
        return "fsdp_all_gather"
    if call.kind == "reduce_scatter":
        return "fsdp_reduce_scatter"
    if call.kind == "all_reduce" and ranks == frozenset(mesh.group_of(me, "dp_replicate")):
        return "hsdp_all_reduce"
    return f"other:{call.kind}:{sorted(ranks)}"


def _measure(dims: tuple[int, int, int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    parallel = ParallelConfig(*dims)
    layout = build_layout(parallel, "cpu")
    torch.manual_seed(0)
    model = Transformer(MODEL)
    parallelize(model, layout)
    optimizer = build_optimizer(model, CONFIG)
    g = torch.Generator().manual_seed(0)
    local = CONFIG.global_batch // parallel.dp

    def step() -> None:
        ids = torch.randint(0, MODEL.vocab_size, (local, CONFIG.seq_len + 1), generator=g)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()

    step()  # optimizer state exists after the first step
    optimizer.zero_grad()
    with CountingMode() as counts:
        step()
    by_kind: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for call in counts.collectives:
        kind = _kind(call, layout)
        by_kind[kind] += call.nbytes
        calls[kind] += 1
    params = list(model.parameters())
    state_bytes = sum(
        v.nbytes
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    muon = optimizer.optimizers[0]  # type: ignore[attr-defined]
    stats = muon.last_step_stats
    return {
        "bytes": dict(by_kind),
        "calls": dict(calls),
        "param_elements": sum(p.numel() for p in params),
        "grad_bytes": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer_state_bytes": state_bytes,
        "muon_sent": stats.bytes_sent,
    }


def _close(predicted: float, measured: float) -> bool:
    if measured == 0:
        return predicted == 0
    return abs(predicted - measured) <= TOLERANCE * measured


@pytest.mark.multiprocess
@pytest.mark.parametrize("dims", [(1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_prediction_matches_a_real_step_within_5_percent(dims: tuple[int, int, int]) -> None:
    world = dims[0] * dims[1] * dims[2]
    measured = run_on_ranks(world, _measure, dims, timeout=300)
    parallel = ParallelConfig(*dims)
    lines = []
    for rank, m in enumerate(measured):
        predicted = predict_for_run(MODEL, parallel, CONFIG, rank=rank)
        assert not [k for k in m["bytes"] if k.startswith("other")], m["bytes"]
        pairs = [
            ("param_elements", predicted.param_elements, m["param_elements"]),
            ("optimizer_state_bytes", predicted.optimizer_state_bytes, m["optimizer_state_bytes"]),
            ("muon sent", predicted.sent_bytes_by_kind.get("muon", 0), m["muon_sent"]),
        ]
        kinds = set(predicted.bytes_by_kind) | set(m["bytes"])
        pairs += [(k, predicted.bytes_by_kind.get(k, 0), m["bytes"].get(k, 0)) for k in kinds]
        for name, want, got in pairs:
            lines.append(f"rank {rank} {name}: predicted {want}, measured {got}")
            assert _close(want, got), lines[-1]
    print(f"{dims}: " + "; ".join(lines[: len(lines) // world]))
