"""Benchmark: pipeline schedules, hp-mpmd's runtime vs ``torch.distributed.pipelining``.

An MLP of ``BLOCKS`` residual blocks (``DIM -> HIDDEN -> DIM``) is split evenly over ``WORLD``
gloo ranks (one stage each; two per rank for interleaved 1F1B). A step is the forward and
backward of one batch of ``BATCH`` rows in ``MICROBATCHES`` microbatches (no optimizer).
Variants: GPipe, 1F1B, interleaved 1F1B (two stages per rank) and ZB-H1 in hp-mpmd, and the
same schedule in torch's pipelining where it has one (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``; torch has no one-stage-per-rank ZB-H1). Variants run in
interleaved rounds (order rotated per round); reported: the median step time over rounds
(slowest rank, between barriers), the ratio to torch's same schedule and to hp GPipe, and the
bubble fraction of each plan from :func:`hp_mpmd.simulate.simulate` (F = 1, B = 2, I = W = 1,
no communication cost; eager sends, and with rendezvous batches).

This machine is shared and noisy, and ``WORLD`` ranks may share fewer cores: compare the ratios
of one run. Run: ``nox -s bench -- pipeline_schedules.py`` (or ``python
benchmarks/pipeline_schedules.py`` with the packages importable).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _machine import machine_line
from torch import nn
from torch.distributed import pipelining as pp

from hp_mpmd import PipelineSchedule, PipelineStage, SchedulePlan, build_stages, layers_of
from hp_mpmd.schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from hp_mpmd.simulate import simulate

WORLD = 4
BLOCKS, DIM, HIDDEN, BATCH, MICROBATCHES = 8, 256, 1024, 64, 8
ROUNDS, WARMUP = 7, 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.w2(torch.relu(self.w1(x)))
        return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _plans() -> dict[str, SchedulePlan]:
    return {
        "gpipe": gpipe(WORLD, MICROBATCHES),
        "1f1b": one_f_one_b(WORLD, MICROBATCHES),
        "interleaved": interleaved_1f1b(WORLD, 2, MICROBATCHES),
        "zb_h1": zero_bubble_h1(WORLD, MICROBATCHES),
    }


def _modules(num_stages: int, stages: tuple[int, ...]) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    layers = layers_of(nn.Sequential(*[_Block() for _ in range(BLOCKS)]))
    per = BLOCKS // num_stages
    cut = build_stages(layers, tuple(range(0, BLOCKS + 1, per)))
    return {s: cut[s] for s in stages}


def _variants(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    rank = dist.get_rank()
    out: dict[str, Callable[[], None]] = {}
    torch_kinds: dict[str, Any] = {
        "gpipe": pp.ScheduleGPipe,
        "1f1b": pp.Schedule1F1B,
        "interleaved": pp.ScheduleInterleaved1F1B,
    }
    for name, plan in _plans().items():
        mods = _modules(plan.num_stages, plan.stages_of(rank))
        stages = [PipelineStage(m, s, plan.num_stages) for s, m in mods.items()]
        ours = PipelineSchedule(plan, stages, _loss)
        first, last = 0 in mods, plan.num_stages - 1 in mods

        def hp_step(
            ours: PipelineSchedule = ours,
            mods: dict[int, nn.Module] = mods,
            first: bool = first,
            last: bool = last,
        ) -> None:
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            ours.step(x if first else None, y if last else None)

        out[f"hp {name}"] = hp_step
        if name not in torch_kinds:
            continue
        tmods = _modules(plan.num_stages, plan.stages_of(rank))
        tstages = [
            pp.PipelineStage(m, s, plan.num_stages, torch.device("cpu")) for s, m in tmods.items()
        ]
        multi = name == "interleaved"
        sched = torch_kinds[name](tstages if multi else tstages[0], MICROBATCHES, loss_fn=_loss)

        def torch_step(
            sched: Any = sched,
            tmods: dict[int, nn.Module] = tmods,
            first: bool = first,
            last: bool = last,
        ) -> None:
            for m in tmods.values():
                m.zero_grad(set_to_none=True)
            args = (x,) if first else ()
            if last:
                sched.step(*args, target=y, losses=[])
            else:
                sched.step(*args)

        out[f"torch {name}"] = torch_step
    return out


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _bench() -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
    variants = _variants(x, y)
    names = list(variants)
    for name in names:
        for _ in range(WARMUP):
            _timed(variants[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_timed(variants[name]))
    medians = torch.tensor([statistics.median(times[n]) for n in names])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(names, (float(v) for v in medians), strict=True))


def _worker(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = _bench()
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    spawn: Any = mp.start_processes  # type: ignore[attr-defined]
    spawn(_worker, args=(port, queue), nprocs=WORLD, start_method="spawn")
    med: dict[str, float] = queue.get()
    bubbles = {
        name: {
            "eager": simulate(plan).bubble_fraction,
            "rendezvous": simulate(plan, rendezvous=True).bubble_fraction,
        }
        for name, plan in _plans().items()
    }
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
        f"{torch.__version__}; {WORLD} gloo ranks, 1 thread each; {BLOCKS} blocks "
        f"({DIM}->{HIDDEN}->{DIM}), batch {BATCH} in {MICROBATCHES} microbatches; median of "
        f"{ROUNDS} interleaved rounds"
    )
    print(
        f"{'schedule':<13}{'hp ms':>9}{'torch ms':>10}{'hp/torch':>10}{'hp/gpipe':>10}"
        f"{'bubble':>8}{'bubble rdv':>12}"
    )
    ratios: dict[str, float] = {}
    for name, b in bubbles.items():
        hp = med[f"hp {name}"]
        theirs = med.get(f"torch {name}")
        if theirs is not None:
            ratios[name] = hp / theirs
        t_ms = f"{theirs * 1e3:>10.1f}" if theirs is not None else f"{'-':>10}"
        ratio = f"{hp / theirs:>10.2f}" if theirs is not None else f"{'-':>10}"
        print(
            f"{name:<13}{hp * 1e3:>9.1f}{t_ms}{ratio}{hp / med['hp gpipe']:>10.2f}"
            f"{b['eager']:>8.2f}{b['rendezvous']:>12.2f}"
        )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "pipeline_schedules",
                "machine": platform.node(),
                "torch": torch.__version__,
                "world": WORLD,
                "config": {
                    "blocks": BLOCKS,
                    "dim": DIM,
                    "hidden": HIDDEN,
                    "batch": BATCH,
                    "microbatches": MICROBATCHES,
                },
                "median_s": med,
                "ratio_hp_vs_torch": ratios,
                "bubble_fraction": bubbles,
            }
        )
    )


if __name__ == "__main__":
    main()
