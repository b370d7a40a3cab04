"""Benchmark: the RL weight sync, hp-layout's direct transfer vs gathering whole tensors
first, side by side in one run, at world 4.

The policy is hp-train's Transformer (dim 512, 4 blocks, vocabulary 8,192: 21M parameters,
84 MB in fp32), laid out for training by hp-rl (FSDP, flat storage, with TP where the case says),
and the rollout engine's copy in its own layout (TP 2 per replica). Two cases:

* ``colocated``: FSDP 2 x TP 2 training and TP 2 x 2 replicas on the same 4 ranks;
* ``disaggregated``: FSDP 2 training on ranks 0-1, one TP 2 replica on ranks 2-3.

The job is planned as two hosts of two ranks (``Topology.two_tier_cluster(2, 2)``: ranks 0-1 and
2-3), so the bytes crossing the slow tier are those a real two-host job would send between
hosts. Every sync is timed (median of ``REPEATS``, each after a barrier) on 4 local CPU ranks
(gloo, one thread each): all tiers are the same loopback here, so the times show the copies and
messages each method needs, and the bytes per tier show what the slow links would carry.
Every synced shard is checked against FSDP's gathered weights (bit for bit) before timing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _machine import machine_line
from _ranks import run_local_ranks

WORLD = 4
REPEATS = 5
CASES = ("colocated", "disaggregated")
METHODS = ("direct", "full_gather")


def _model_config() -> Any:
    from hp_train.config.schema import ModelConfig

    return ModelConfig(
        vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=64
    )


def _roles(case: str) -> Any:
    from hp_rl.roles import plan_roles

    if case == "colocated":
        return plan_roles(WORLD, tp=2, rollout_tp=2)
    return plan_roles(WORLD, placement="disaggregated", rollout_tp=2, rollout_ranks=2)


def _rank(case: str) -> dict[str, Any]:
    from hp_layout import Topology
    from hp_rl.models import build_policy, build_rollout_model, create_groups, local_layouts
    from hp_rl.weight_sync import connect_weight_sync
    from hp_train.config.schema import TrainConfig

    rank = dist.get_rank()
    roles = _roles(case)
    create_groups(roles)
    cpu = torch.device("cpu")
    policy = (
        build_policy(_model_config(), roles, rank, train=TrainConfig(), device=cpu)
        if roles.trains(rank)
        else None
    )
    rollout = (
        build_rollout_model(_model_config(), roles, device=cpu) if roles.rolls_out(rank) else None
    )
    topology = Topology.two_tier_cluster(2, 2)
    out: dict[str, Any] = {}
    for method in METHODS:
        sync = connect_weight_sync(
            None if policy is None else local_layouts(policy),
            None if rollout is None else local_layouts(rollout),
            method=method,
            topology=topology,
        )
        times = []
        for version in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            sync.run(version)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[method] = {
            "seconds": float(slowest),
            "tiers": sync.plan.bytes_by_tier(topology),
            "moved": sync.plan.bytes_moved(),
        }
    _check(policy, rollout, roles)
    return out


def _check(policy: Any, rollout: Any, roles: Any) -> None:
    """Every rollout shard equals torch.chunk of FSDP's gathered weight (the last sync)."""
    from hp_rl.models import local_layouts
    from hp_train.objects import gather_objects

    full = None
    if policy is not None:
        full = {n: v.full_tensor() for n, v in policy.state_dict().items()}
    local = None if rollout is None else {n: t for n, (_, t) in local_layouts(rollout).items()}
    tp_rank = roles.rollout_ranks.index(dist.get_rank()) % 2 if local is not None else None
    everyone = gather_objects((full, local, tp_rank), "benchmark check gather")
    whole = next(e[0] for e in everyone if e[0] is not None)
    for _, shards, k in everyone:
        for name, shard in (shards or {}).items():
            w = whole[name]
            dims = [d for d in range(w.dim()) if w.shape[d] != shard.shape[d]]
            want = torch.chunk(w, 2, dim=dims[0])[k] if dims else w
            if not torch.equal(shard, want):
                raise AssertionError(f"{name}: the synced shard differs from the trained weight")


def main() -> None:
    print(machine_line())
    params = sum(
        p.numel()
        for p in __import__("hp_train.model.llama", fromlist=["x"])
        .Transformer(_model_config())
        .parameters()
    )
    print(f"policy: {params / 1e6:.1f}M parameters, {params * 4 / 1e6:.0f} MB fp32; world {WORLD}")
    print(
        f"{'case':<14} {'method':<12} {'sync ms':>8} {'MB moved':>9} {'MB slow tier':>13} "
        f"{'MB fast tier':>13}"
    )
    for case in CASES:
        result = run_local_ranks(WORLD, _rank, case)
        for method in METHODS:
            r = result[method]
            print(
                f"{case:<14} {method:<12} {r['seconds'] * 1e3:>8.1f} {r['moved'] / 1e6:>9.1f} "
                f"{r['tiers']['cluster'] / 1e6:>13.1f} {r['tiers']['host'] / 1e6:>13.1f}"
            )
        d, g = result["direct"], result["full_gather"]
        print(
            f"{case:<14} full_gather / direct: time {g['seconds'] / d['seconds']:.2f}x, slow-tier "
            f"bytes {g['tiers']['cluster'] / max(d['tiers']['cluster'], 1):.2f}x"
        )


if __name__ == "__main__":
    main()
