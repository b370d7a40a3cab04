"""Benchmark: per-op host overhead of hp_dtensor's DTensor vs plain tensors vs torch DTensor.

Two gloo ranks on this machine, tiny shapes (the op itself costs ~1 us, so what is measured is
the dispatch overhead), ops that need no communication: ``add`` of two sharded tensors,
``mm`` of a replicated activation with a column-sharded weight, and ``linear`` forward plus
backward with a column-sharded weight. Each variant is timed in interleaved rounds and the
median per-op time is reported with ratios against plain tensors. Prints a table and one
JSON line.

Run: ``nox -s bench -- dtensor_overhead.py`` (or ``python benchmarks/dtensor_overhead.py``
with the packages installed).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import machine_line
from _ranks import run_local_ranks

ROUNDS, ITERS = 7, 300


def _time(fn: Callable[[], object]) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(ITERS):
        fn()
    return (time.perf_counter() - start) / ITERS


def _workloads() -> dict[str, dict[str, Callable[[], object]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as tdist

    from hp_dtensor import DeviceMesh, Replicate, Shard, distribute_tensor
    from hp_layout import Mesh

    world = dist.get_world_size()
    ours = DeviceMesh("cpu", Mesh((world,), ("tp",)))
    theirs = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    local_w = w.chunk(world, 0)[dist.get_rank()].clone()
    local_w_cols = w.chunk(world, 1)[dist.get_rank()].clone()

    def plain_linear() -> None:
        lw = local_w.detach().requires_grad_()
        F.linear(x, lw).sum().backward()

    oa, ob = distribute_tensor(a, ours, [Shard(0)]), distribute_tensor(b, ours, [Shard(0)])
    ta, tb = tdist(a, theirs, [TorchShard(0)]), tdist(b, theirs, [TorchShard(0)])
    ox, ow = distribute_tensor(x, ours, [Replicate()]), distribute_tensor(w, ours, [Shard(1)])
    tx, tw = tdist(x, theirs, [TorchReplicate()]), tdist(w, theirs, [TorchShard(1)])
    ow_g = distribute_tensor(w, ours, [Shard(0)]).requires_grad_()
    tw_g = tdist(w, theirs, [TorchShard(0)]).requires_grad_()
    la, lb = a.chunk(world, 0)[dist.get_rank()], b.chunk(world, 0)[dist.get_rank()]
    return {
        "add": {
            "plain": lambda: la + lb,
            "hp_dtensor": lambda: oa + ob,
            "torch_dtensor": lambda: ta + tb,
        },
        "mm": {
            "plain": lambda: torch.mm(x, local_w_cols),
            "hp_dtensor": lambda: torch.mm(ox, ow),
            "torch_dtensor": lambda: torch.mm(tx, tw),
        },
        "linear+grad": {
            "plain": plain_linear,
            "hp_dtensor": lambda: F.linear(ox, ow_g).sum().backward(),
            "torch_dtensor": lambda: F.linear(tx, tw_g).sum().backward(),
        },
    }


def _rank() -> dict[str, dict[str, float]]:
    samples: dict[str, dict[str, list[float]]] = {}
    workloads = _workloads()
    for _ in range(ROUNDS):
        for op, variants in workloads.items():
            for name, fn in variants.items():
                dist.barrier()
                samples.setdefault(op, {}).setdefault(name, []).append(_time(fn))
    return {op: {n: statistics.median(v) for n, v in d.items()} for op, d in samples.items()}


def main() -> None:
    print(machine_line())
    world = 2
    medians = run_local_ranks(world, _rank)
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, {world} gloo ranks"
    )
    header = (
        f"{'op':<13}{'plain us':>10}{'hp us':>9}{'torch us':>10}"
        f"{'hp/plain':>10}{'torch/plain':>12}{'hp/torch':>10}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for op, m in medians.items():
        plain, ours, theirs = m["plain"] * 1e6, m["hp_dtensor"] * 1e6, m["torch_dtensor"] * 1e6
        rows.append(
            {
                "op": op,
                "plain_us": plain,
                "hp_us": ours,
                "torch_us": theirs,
                "hp_vs_plain": ours / plain,
                "torch_vs_plain": theirs / plain,
                "hp_vs_torch": ours / theirs,
            }
        )
        print(
            f"{op:<13}{plain:>10.1f}{ours:>9.1f}{theirs:>10.1f}"
            f"{ours / plain:>10.2f}{theirs / plain:>12.2f}{ours / theirs:>10.2f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "dtensor_overhead",
                "machine": platform.node(),
                "world": world,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
