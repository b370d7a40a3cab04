"""Benchmark: one distributed Muon step, hp-muon vs gathering everything, vs one device.

The Muon matrices of a Llama-style model (``LAYERS`` blocks of q, k, v, o ``dim x dim``, w1, w3
``ffn x dim``, w2 ``dim x ffn``) are sharded as torch FSDP2 shards them (``Shard(0)`` torch
DTensors over all ranks). A step is the optimizer step alone (gradients are set beforehand).
Variants, on ``WORLD`` gloo ranks of this machine with one thread each:

* ``hp``: ``hp_muon.Muon`` as shipped (shape fusion off on the CPU): each matrix gathered in
  bf16 to one owner (balanced by Newton-Schulz cost), orthogonalized once, results scattered;
* ``hp fused``: the same with ``fuse_shapes=True`` (same-shape matrices in one ``bmm`` chain);
* ``gather-all``: what a sharder-unaware Muon must do: every rank all-gathers every matrix's
  Newton-Schulz input (bf16, the same bytes per element as ``hp``) and orthogonalizes every
  matrix, keeping its own rows;
* ``torch 1 rank``: ``torch.optim.Muon`` on the whole matrices on rank 0 (the single-device
  step; the other ranks wait).

Variants run in interleaved rounds (order rotated per round); reported: the median over rounds
of the step time (slowest rank), ratios, and the bytes each rank sends per step. This machine
is shared and noisy, and ``WORLD`` ranks may share fewer cores: compare the ratios of one run.
A second table times the Newton-Schulz kernel alone on one process: the same matrices
orthogonalized one by one and batched by shape.

Run: ``nox -s bench -- muon_step.py`` (or ``python benchmarks/muon_step.py`` with the packages
importable).
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
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hp_kernels.precision import bf16_matmul_is_slow, newton_schulz_dtype
from hp_muon import Muon, coefficient_schedule, orthogonalize_many
from hp_muon.newton_schulz import orthogonalize

WORLD = 4
LAYERS, DIM, FFN = 4, 384, 1024
ROUNDS, WARMUP = 5, 1
LR, MOMENTUM, EPS, NS_STEPS = 0.02, 0.95, 1e-7, 5
# Newton-Schulz runs in what hp-muon picks on this CPU (fp32 where bf16 matmuls are slow) for
# hp, gather-all and the kernel table alike; torch.optim.Muon has only bf16, which costs tens
# of seconds a step on such a CPU, so there it is timed in one round, without a warm-up.
NS_DTYPE = newton_schulz_dtype("cpu")
TORCH_ROUNDS = 1 if bf16_matmul_is_slow("cpu") else ROUNDS


def _shapes() -> list[tuple[int, int]]:
    block = [(DIM, DIM)] * 4 + [(FFN, DIM), (FFN, DIM), (DIM, FFN)]
    return block * LAYERS


def _fulls(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in _shapes()]


class _GatherAll:
    """Muon that all-gathers every matrix to every rank and orthogonalizes all of them."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.momentum = [torch.zeros_like(p.to_local()) for p in params]  # type: ignore[attr-defined]
        self.schedule = coefficient_schedule("keller", NS_STEPS)
        self.bytes_sent = 0

    @torch.no_grad()
    def step(self) -> None:
        sent = 0
        for p, buf in zip(self.params, self.momentum, strict=True):
            assert isinstance(p, DTensor)
            assert isinstance(p.grad, DTensor)
            grad = p.grad.to_local()
            buf.lerp_(grad, 1 - MOMENTUM)
            local = grad.lerp(buf, MOMENTUM).bfloat16()
            update = DTensor.from_local(local, p.device_mesh, p.placements)
            whole = update.redistribute(p.device_mesh, [Replicate()]).to_local()
            sent += local.numel() * 2 * (dist.get_world_size() - 1)
            ortho = orthogonalize(whole, self.schedule, EPS, dtype=NS_DTYPE)
            rows, cols = whole.shape
            rate = LR * max(1, rows / cols) ** 0.5
            start = dist.get_rank() * -(-rows // dist.get_world_size())
            mine = ortho[start : start + local.shape[0]]
            p.to_local().add_(mine.to(p.dtype), alpha=-rate)
        self.bytes_sent = sent


def _sharded(fulls: list[torch.Tensor]) -> list[nn.Parameter]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]


def _set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        else:
            p.grad = g.clone()


def _variants(
    fulls: list[torch.Tensor],
) -> dict[str, tuple[Callable[[], object], Callable[[], int]]]:
    rank = dist.get_rank()
    hp_params, fused_params, naive_params = _sharded(fulls), _sharded(fulls), _sharded(fulls)
    hp = Muon(hp_params, lr=LR, momentum=MOMENTUM)
    fused = Muon(fused_params, lr=LR, momentum=MOMENTUM, fuse_shapes=True)
    naive = _GatherAll(naive_params)
    whole = [nn.Parameter(f.clone()) for f in fulls]
    reference = torch.optim.Muon(whole, lr=LR, momentum=MOMENTUM)
    grads = _fulls(1)
    for params in (hp_params, fused_params, naive_params, whole):
        _set_grads(params, grads)

    def one_rank() -> None:
        if rank == 0:
            reference.step()

    def stats_bytes(opt: Muon) -> Callable[[], int]:
        return lambda: opt.last_step_stats.bytes_sent if opt.last_step_stats else 0

    return {
        "hp": (hp.step, stats_bytes(hp)),
        "hp fused": (fused.step, stats_bytes(fused)),
        "gather-all": (naive.step, lambda: naive.bytes_sent),
        "torch 1 rank": (one_rank, lambda: 0),
    }


def _timed(step: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _bench() -> dict[str, Any]:
    variants = _variants(_fulls(0))
    names = list(variants)
    rounds = {n: TORCH_ROUNDS if n == "torch 1 rank" else ROUNDS for n in names}
    for name in names:
        for _ in range(WARMUP if rounds[name] == ROUNDS else 0):
            _timed(variants[name][0])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if len(times[name]) < rounds[name]:
                times[name].append(_timed(variants[name][0]))
    sent = {n: variants[n][1]() for n in names}
    totals = torch.tensor([float(sent[n]) for n in names])
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return {
        "median_s": {n: statistics.median(times[n]) for n in names},
        "max_bytes_sent_per_rank": dict(zip(names, (int(v) for v in totals), strict=True)),
    }


def _kernel() -> dict[str, float]:
    """Newton-Schulz alone on one process: one by one vs batched by shape."""
    torch.set_num_threads(1)
    mats = _fulls(2)
    schedule = coefficient_schedule("keller", NS_STEPS)
    times: dict[str, list[float]] = {"one by one": [], "batched": []}
    for r in range(ROUNDS + WARMUP):
        for label, fuse in (("one by one", False), ("batched", True))[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            orthogonalize_many(mats, schedule, EPS, fuse=fuse, dtype=NS_DTYPE)
            if r >= WARMUP:
                times[label].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    result = run_local_ranks(WORLD, _bench)
    kernel = _kernel()
    shapes = _shapes()
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
        f"{torch.__version__}; {WORLD} gloo ranks, 1 thread each; {len(shapes)} matrices "
        f"({LAYERS} blocks, dim {DIM}, ffn {FFN}), {NS_STEPS} Newton-Schulz steps; median of "
        f"{ROUNDS} interleaved rounds ({TORCH_ROUNDS} of torch 1 rank); Newton-Schulz in "
        f"{str(NS_DTYPE).removeprefix('torch.')} (torch.optim.Muon: bf16)"
    )
    med, sent = result["median_s"], result["max_bytes_sent_per_rank"]
    print(
        f"{'variant':<14}{'step ms':>10}{'x gather-all':>14}{'x torch 1 rank':>16}{'MiB sent':>10}"
    )
    for name, t in med.items():
        print(
            f"{name:<14}{t * 1e3:>10.1f}{t / med['gather-all']:>14.2f}"
            f"{t / med['torch 1 rank']:>16.2f}{sent[name] / 2**20:>10.2f}"
        )
    print(
        f"Newton-Schulz alone, one process: one by one {kernel['one by one'] * 1e3:.1f} ms, "
        f"batched {kernel['batched'] * 1e3:.1f} ms "
        f"(x{kernel['batched'] / kernel['one by one']:.2f})"
    )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "muon_step",
                "machine": platform.node(),
                "torch": torch.__version__,
                "world": WORLD,
                "matrices": len(shapes),
                "config": {"layers": LAYERS, "dim": DIM, "ffn": FFN, "ns_steps": NS_STEPS},
                "median_s": med,
                "ratio_vs_gather_all": {n: t / med["gather-all"] for n, t in med.items()},
                "ratio_vs_torch_1_rank": {n: t / med["torch 1 rank"] for n, t in med.items()},
                "max_bytes_sent_per_rank": sent,
                "newton_schulz_s": kernel,
            }
        )
    )


if __name__ == "__main__":
    main()
