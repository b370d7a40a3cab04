"""Benchmark: one MoE layer step (forward + backward), expert parallel vs one rank.

An :class:`hp_train.model.moe.MoE` (``EXPERTS`` SwiGLU experts of ``DIM x HIDDEN``, top-
``TOP_K`` softmax routing, one shared expert, auxiliary loss) on ``WORLD`` gloo ranks with one
thread each. Variants:

* ``1 rank``: the whole MoE on rank 0 over all ranks' tokens (``WORLD * TOKENS``; the
  single-device step; the other ranks wait);
* ``EP``: ``ExpertParallel`` in production mode, each rank its own ``TOKENS`` tokens and
  ``EXPERTS / WORLD`` experts; tokens move by ragged all-to-all, router and shared-expert
  gradients are summed over the ranks.

Variants run in interleaved rounds; reported: the median over rounds of the step time
(slowest rank), the ratio to ``1 rank``, and the bytes each rank sends per step (counted at
the ``torch.distributed`` calls: all-to-all bytes to other ranks, ring estimates
``2 (n-1)/n`` for all-reduce and ``(n-1)/n`` for all-gather). This machine is shared and
noisy, and ranks may share fewer cores: compare the ratios of one run.

Run: ``nox -s bench -- moe_expert_parallel.py`` (or ``python benchmarks/moe_expert_parallel.py``
with the packages importable).
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
from _machine import machine_line
from _ranks import run_local_ranks

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ExpertParallel, parallelize_module
from hp_layout import Mesh
from hp_train.model.moe import MoE

WORLD = int(os.environ.get("WORLD", "2"))
DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 512, 8, 2, 2048
ROUNDS, WARMUP = 5, 1

_SENT = [0]


def _count_bytes() -> None:
    """Wrap the torch.distributed calls hp_dtensor uses so each adds its sent bytes."""
    calls: dict[str, Callable[..., Any]] = {
        name: getattr(dist, name)
        for name in ("all_to_all_single", "all_reduce", "all_gather_single")
        if hasattr(dist, name)
    }

    def sent(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        group = kwargs.get("group")
        n = dist.get_world_size(group)
        if name == "all_to_all_single":
            x = args[1]
            splits = kwargs.get("input_split_sizes") or [x.numel() // n] * n
            return int((sum(splits) - splits[dist.get_rank(group)]) * x.element_size())
        x = args[0] if name == "all_reduce" else args[1]
        factor = 2 * (n - 1) / n if name == "all_reduce" else n - 1
        return int(factor * x.numel() * x.element_size())

    def wrap(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            _SENT[0] += sent(name, args, kwargs)
            return call(*args, **kwargs)

        return counted

    for name, call in calls.items():
        setattr(dist, name, wrap(name, call))


def _build() -> MoE:
    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, EXPERTS, TOP_K, shared_hidden=HIDDEN, aux_loss_coef=0.01)


def _bench() -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", Mesh((WORLD,), ("ep",)))
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(WORLD * TOKENS, DIM, generator=g)
    x_local = x_all.chunk(WORLD)[rank]
    single = _build() if rank == 0 else None
    ep = parallelize_module(_build(), mesh, {"": ExpertParallel()}, mode="production", tp_axis="ep")

    def one_rank() -> None:
        if single is not None:
            (single(x_all).square().mean()).backward()

    def expert_parallel() -> None:
        y = ep(x_local)
        (y.square().sum() / (WORLD * TOKENS * DIM)).backward()

    variants: dict[str, Callable[[], None]] = {"1 rank": one_rank, "EP": expert_parallel}
    times: dict[str, list[float]] = {n: [] for n in variants}
    sent: dict[str, int] = {}
    names = list(variants)
    for r in range(ROUNDS + WARMUP):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            before = _SENT[0]
            start = time.perf_counter()
            variants[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            sent[name] = _SENT[0] - before
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if r >= WARMUP:
                times[name].append(float(elapsed))
    totals = torch.tensor([float(sent[n]) for n in names])
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return {
        "median_s": {n: statistics.median(times[n]) for n in names},
        "max_bytes_sent_per_rank": dict(zip(names, (int(v) for v in totals), strict=True)),
    }


def _rank() -> dict[str, Any]:
    _count_bytes()
    return _bench()


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    result = run_local_ranks(WORLD, _rank)
    med, sent = result["median_s"], result["max_bytes_sent_per_rank"]
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
        f"{torch.__version__}; {WORLD} gloo ranks, 1 thread each; MoE dim {DIM}, hidden "
        f"{HIDDEN}, {EXPERTS} experts, top-{TOP_K}, 1 shared expert, {TOKENS} tokens per rank; "
        f"median of {ROUNDS} interleaved rounds"
    )
    print(f"{'variant':<10}{'step ms':>10}{'x 1 rank':>10}{'MiB sent':>10}")
    for name, t in med.items():
        print(f"{name:<10}{t * 1e3:>10.1f}{t / med['1 rank']:>10.2f}{sent[name] / 2**20:>10.2f}")
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "moe_expert_parallel",
                "machine": platform.node(),
                "torch": torch.__version__,
                "world": WORLD,
                "config": {
                    "dim": DIM,
                    "hidden": HIDDEN,
                    "experts": EXPERTS,
                    "top_k": TOP_K,
                    "tokens_per_rank": TOKENS,
                },
                "median_s": med,
                "ratio_vs_1_rank": {n: t / med["1 rank"] for n, t in med.items()},
                "max_bytes_sent_per_rank": sent,
            }
        )
    )


if __name__ == "__main__":
    main()
