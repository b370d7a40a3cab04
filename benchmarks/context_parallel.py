"""Benchmark: context-parallel causal attention (ring, Ulysses) vs the whole sequence on one rank.

One step is the forward and backward of causal attention on ``[BATCH, HEADS, SEQ, HEAD]`` fp32
query, key and value. Variants, for each CP size in ``WORLDS`` (gloo ranks of this machine,
one thread each):

* ``1 rank``: ``F.scaled_dot_product_attention(is_causal=True)`` on the whole sequence on rank
  0 (the single-device step; the other ranks wait);
* ``ring``: ``hp_dtensor`` ring attention, load-balanced (zigzag) sequence sharding;
* ``ring contiguous``: the same on the contiguous sharding (no load balancing: the last rank
  has all the work, the first almost none);
* ``ulysses``: all-to-all heads <-> sequence around a local causal SDPA (zigzag sharding).

Variants run in interleaved rounds (order rotated per round); reported: the median over rounds
of the step time (slowest rank), the ratio to ``1 rank``, and the bytes each rank sends per
step (counted at the ``torch.distributed`` calls, forward and backward). This machine is
shared and noisy, and the ranks may share fewer cores than there are ranks: compare the ratios
of one run.

Run: ``nox -s bench -- context_parallel.py`` (or ``python benchmarks/context_parallel.py`` with
the packages importable).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import machine_line
from _ranks import run_local_ranks

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import shard_sequence
from hp_dtensor.parallel.context_attention import ring_attention, ulysses_attention
from hp_layout import Mesh

WORLDS = (2, 4)
BATCH, HEADS, SEQ, HEAD = 1, 8, 1024, 64
ROUNDS, WARMUP = 5, 1

_SENT = [0]


def _count_bytes() -> None:
    """Count the bytes this rank sends through the collectives context parallelism uses."""
    all_to_all = dist.all_to_all_single
    batch = dist.batch_isend_irecv

    def counted_all_to_all(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        splits = kwargs.get("input_split_sizes")
        me = dist.get_rank(kwargs.get("group"))
        per = (
            splits
            if splits
            else [input.numel() // dist.get_world_size(kwargs.get("group"))]
            * (dist.get_world_size(kwargs.get("group")))
        )
        _SENT[0] += (sum(per) - per[me]) * input.element_size()
        return all_to_all(output, input, *args, **kwargs)

    def counted_batch(ops: list[Any]) -> Any:
        for op in ops:
            if op.op is dist.isend:
                _SENT[0] += op.tensor.numel() * op.tensor.element_size()
        return batch(ops)

    dist.all_to_all_single = counted_all_to_all
    dist.batch_isend_irecv = counted_batch  # type: ignore[assignment]


def _variants(world: int) -> dict[str, Callable[[], None]]:
    mesh = DeviceMesh("cpu", Mesh((world,), ("cp",)))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(BATCH, HEADS, SEQ, HEAD, generator=g) for _ in range(4)]

    def one_rank() -> None:
        if rank == 0:
            q, k, v = (t.clone().requires_grad_() for t in whole[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(whole[3])

    def sharded(fn: Callable[..., torch.Tensor], balanced: bool) -> Callable[[], None]:
        local = [shard_sequence(t, 2, mesh, "cp", balanced=balanced) for t in whole]

        def step() -> None:
            q, k, v = (t.clone().requires_grad_() for t in local[:3])
            fn(q, k, v, mesh, "cp", balanced=balanced).backward(local[3])

        return step

    return {
        "1 rank": one_rank,
        "ring": sharded(ring_attention, True),
        "ring contiguous": sharded(ring_attention, False),
        "ulysses": sharded(ulysses_attention, True),
    }


def _timed(step: Callable[[], None]) -> tuple[float, int]:
    dist.barrier()
    before = _SENT[0]
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start, _SENT[0] - before


def _bench(world: int) -> dict[str, Any]:
    variants = _variants(world)
    names = list(variants)
    for name in names:
        for _ in range(WARMUP):
            _timed(variants[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    sent: dict[str, int] = {}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            elapsed, moved = _timed(variants[name])
            times[name].append(elapsed)
            sent[name] = moved
    totals = torch.tensor([float(sent[n]) for n in names])
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return {
        "median_s": {n: statistics.median(times[n]) for n in names},
        "max_bytes_sent_per_rank": dict(zip(names, (int(v) for v in totals), strict=True)),
    }


def _rank(world: int) -> dict[str, Any]:
    _count_bytes()
    return _bench(world)


def _run(world: int) -> dict[str, Any]:
    result: dict[str, Any] = run_local_ranks(world, _rank, world)
    return result


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    results = {world: _run(world) for world in WORLDS}
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
        f"{torch.__version__}; gloo ranks, 1 thread each; causal attention fwd+bwd, fp32, "
        f"[batch {BATCH}, heads {HEADS}, seq {SEQ}, head {HEAD}]; median of {ROUNDS} "
        "interleaved rounds"
    )
    print(f"{'cp':>3}  {'variant':<16}{'step ms':>10}{'x 1 rank':>10}{'MiB sent/rank':>15}")
    for world, result in results.items():
        med, sent = result["median_s"], result["max_bytes_sent_per_rank"]
        for name, t in med.items():
            print(
                f"{world:>3}  {name:<16}{t * 1e3:>10.1f}{t / med['1 rank']:>10.2f}"
                f"{sent[name] / 2**20:>15.2f}"
            )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "context_parallel",
                "machine": platform.node(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "config": {"batch": BATCH, "heads": HEADS, "seq": SEQ, "head": HEAD},
                "results": {
                    str(world): {
                        "median_s": r["median_s"],
                        "ratio_vs_1_rank": {
                            n: t / r["median_s"]["1 rank"] for n, t in r["median_s"].items()
                        },
                        "max_bytes_sent_per_rank": r["max_bytes_sent_per_rank"],
                    }
                    for world, r in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
