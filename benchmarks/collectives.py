"""Benchmark: which primitive carries each FSDP collective fastest on this backend.

hp-fsdp reduce-scatters gradients either with the backend's ``reduce_scatter_single`` or with
one ``all_to_all_single`` of the chunks and a local sum (``hp_fsdp._collectives``), and
all-gathers parameters with ``all_gather_single`` (an all-to-all alternative is measured too).
This script times each on local gloo ranks (one thread each) at worlds 2 and 4 and three shard
sizes, checks the all-to-all forms give the same results as the native ones (bit-equal at world
2, within fp32 rounding at 4), and prints the median of 15 timed calls per case, interleaved.
Its figures are the table ``hp_fsdp._collectives`` cites. Compare ratios of one run only.

Run: ``nox -s bench -- collectives.py`` (or ``python benchmarks/collectives.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _machine import machine_info, machine_line
from _ranks import run_local_ranks

SHARD_ELEMENTS = (64 * 1024, 256 * 1024, 1024 * 1024)  # fp32: 256 KiB, 1 MiB, 4 MiB per rank
WORLDS = (2, 4)
ROUNDS = 15


def _one_size(n: int, world: int, rank: int) -> dict[str, float]:
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(rank)
    shard, grad = torch.randn(n, generator=g), torch.randn(world * n, generator=g)
    gathered, reduced = torch.empty(world * n), torch.empty(n)

    def all_gather() -> None:
        dist.all_gather_single(gathered, shard)

    def all_gather_a2a() -> None:
        dist.all_to_all_single(gathered, shard.repeat(world))

    def reduce_scatter() -> None:
        dist.reduce_scatter_single(reduced, grad)

    def reduce_scatter_a2a() -> None:
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad)
        torch.sum(received.view(world, n), dim=0, out=reduced)

    cases: dict[str, Callable[[], None]] = {
        "all_gather": all_gather,
        "all_gather_a2a": all_gather_a2a,
        "reduce_scatter": reduce_scatter,
        "reduce_scatter_a2a": reduce_scatter_a2a,
    }
    reduce_scatter()
    native = reduced.clone()
    reduce_scatter_a2a()
    error = (reduced - native).abs().max().item()
    out[f"rs_error/{n}"] = error
    for f in cases.values():
        f()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, f in cases.items():
            dist.barrier()
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    for name, samples in times.items():
        out[f"{name}/{n}"] = statistics.median(samples) * 1e3
    return out


def _rank() -> dict[str, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, float] = {}
    for n in SHARD_ELEMENTS:
        out.update(_one_size(n, world, rank))
    return out


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    results = {world: run_local_ranks(world, _rank) for world in WORLDS}
    print(
        f"{'world':>5} {'grad/rank':>10} {'AG':>8} {'AG a2a':>8} {'RS':>8} {'RS a2a':>8} "
        f"{'RS a2a/RS':>9} {'RS |diff|':>10}"
    )
    for world, r in results.items():
        for n in SHARD_ELEMENTS:
            rs, rs_a2a = r[f"reduce_scatter/{n}"], r[f"reduce_scatter_a2a/{n}"]
            print(
                f"{world:>5} {world * n * 4 / 2**20:>7.2f} MiB {r[f'all_gather/{n}']:>8.2f} "
                f"{r[f'all_gather_a2a/{n}']:>8.2f} {rs:>8.2f} {rs_a2a:>8.2f} "
                f"{rs_a2a / rs:>8.2f}x {r[f'rs_error/{n}']:>10.2g}"
            )
    print("times in ms, median of 15 per case on rank 0; AG = all-gather, RS = reduce-scatter")
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "collectives",
                "machine": machine_info(),
                "results": {str(w): r for w, r in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
