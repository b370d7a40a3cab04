"""Benchmark: redistribution planning at scale (pure Python, no torch).

Plans a set of layout pairs typical of 3-D parallel training on 768- and 1536-rank meshes
(Ascend supernode topology), cold (cache cleared) and warm (cached), and compares the planned
bytes with the gather-everything-then-slice baseline. Prints a table and one JSON line.

Run: ``python benchmarks/layout_planning.py`` with hp-layout installed (``nox -s bench-layout``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from _machine import machine_line

from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Replicate,
    Shard,
    Topology,
    plan_flat_buffer,
    plan_gather_then_slice,
    plan_redistribute,
)
from hp_layout.redistribute import _search

BF16 = 2


def _cases() -> list[tuple[str, Layout, Layout, Topology]]:
    one = Topology.ascend_supernode(1)
    two = Topology.ascend_supernode(2)
    m3 = Mesh((8, 12, 8), ("pp", "dp", "tp"))
    hsdp = Mesh((2, 48, 16), ("replicate", "shard", "tp"))
    w = (4096, 11008)
    packed = plan_flat_buffer([(4096 // 16, 11008)], shards=48)
    tp = Layout(w, hsdp, [Replicate(), Replicate(), Shard(0)])
    fsdp = packed.layout(0, hsdp, "shard", base=tp)
    return [
        (
            "transpose 3-axis",
            Layout(w, m3, [Replicate(), Shard(0), Shard(1)]),
            Layout(w, m3, [Shard(1), Replicate(), Shard(0)]),
            one,
        ),
        ("fsdp all-gather", fsdp, tp, two),
        (
            "hsdp grad reduce",
            Layout(w, hsdp, [Partial(), Partial(), Shard(0)]),
            Layout(w, hsdp, [Replicate(), Replicate(), Shard(0)]),
            two,
        ),
        (
            "seq->head (a2a)",
            Layout((8, 4096, 128), hsdp, [Replicate(), Shard(1), Shard(2)]),
            Layout((8, 4096, 128), hsdp, [Replicate(), Shard(0), Replicate()]),
            two,
        ),
        (
            "rowwise out -> SP",
            Layout((16, 4096, 4096), m3, [Replicate(), Shard(0), Partial()]),
            Layout((16, 4096, 4096), m3, [Replicate(), Shard(0), Shard(1)]),
            one,
        ),
    ]


def main() -> None:
    print(machine_line())
    rows = []
    for name, src, dst, topo in _cases():
        cold = []
        for _ in range(5):
            _search.cache_clear()
            start = time.perf_counter()
            plan = plan_redistribute(src, dst, topo)
            cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(1000):
            plan_redistribute(src, dst, topo)
        warm = (time.perf_counter() - start) / 1000
        naive = plan_gather_then_slice(src, dst)
        slow = topo.tiers[-1].name
        rows.append(
            {
                "case": name,
                "ranks": src.mesh.size,
                "steps": len(plan.steps),
                "cold_ms": statistics.median(cold) * 1e3,
                "warm_us": warm * 1e6,
                "bytes_vs_naive": plan.bytes_moved(BF16) / max(1, naive.bytes_moved(BF16)),
                "slow_tier_bytes_vs_naive": plan.bytes_by_tier(topo, BF16)[slow]
                / max(1, naive.bytes_by_tier(topo, BF16)[slow]),
                "time_vs_naive": plan.estimated_time(topo, BF16)
                / max(1e-12, naive.estimated_time(topo, BF16)),
            }
        )
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"python {platform.python_version()}"
    )
    header = (
        f"{'case':<20}{'ranks':>6}{'steps':>6}{'cold ms':>9}{'warm us':>9}"
        f"{'bytes/naive':>13}{'slow/naive':>12}{'time/naive':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<20}{r['ranks']:>6}{r['steps']:>6}{r['cold_ms']:>9.1f}{r['warm_us']:>9.2f}"
            f"{r['bytes_vs_naive']:>13.3f}{r['slow_tier_bytes_vs_naive']:>12.3f}"
            f"{r['time_vs_naive']:>12.3f}"
        )
    print(json.dumps({"benchmark": "layout_planning", "machine": platform.node(), "rows": rows}))


if __name__ == "__main__":
    main()
