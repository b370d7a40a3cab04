"""Benchmark: every hp-kernels op against its pure-PyTorch reference, side by side in one run.

* ``pack`` / ``unpack``: an FSDP bucket of ``BLOCKS`` Llama-style blocks (q, k, v, o
  ``dim x dim``; w1, w3 ``ffn x dim``; w2 ``dim x ffn``; two norm vectors; a ``1e4``-element
  extra) packed into one flat buffer and back, for fp32 -> bf16 (mixed-precision all-gather
  input), bf16 -> fp32 and fp32 -> fp32. Compared with the two best pure-PyTorch references:
  a loop of ``out[o:o + n].view(shape).copy_(t)`` and ``torch._foreach_copy_`` over the same
  views (one multi-tensor call). The ratio is the faster reference's time over the kernel's.
  Run with 1 thread and with every core of the machine.
* ``newton_schulz``: batches of same-shape matrices (and one 2-D matrix), the op (C++
  extension on CPU) vs the reference op sequence in Python.
* ``all_gather_matmul`` / ``matmul_reduce_scatter`` on 2 gloo ranks: on CPU both are the
  decomposed reference, so this measures the op's dispatch overhead against calling the
  functional collective and the matmul by hand.

Each measurement is the median of interleaved rounds (order rotated per round). This machine
is shared and noisy: compare the ratios of one run, not absolute times.

Run: ``nox -s bench -- kernels.py`` (or ``python benchmarks/kernels.py`` with hp_kernels
importable).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from _machine import machine_line
from _ranks import run_local_ranks

import hp_kernels
from hp_kernels import reference

BLOCKS, DIM, FFN = 3, 1024, 2816
ROUNDS = 9
NS_SHAPES = [(8, 256, 256), (4, 256, 704), (16, 128, 128), (1, 512, 1376)]


def _median_times(
    variants: Mapping[str, Callable[[], object]], rounds: int = ROUNDS
) -> dict[str, float]:
    for f in variants.values():  # warm-up (page faults, lazy init)
        f()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def _bucket_shapes() -> list[tuple[int, ...]]:
    block = [(DIM, DIM)] * 4 + [(FFN, DIM), (FFN, DIM), (DIM, FFN), (DIM,), (DIM,), (10_000,)]
    return block * BLOCKS


def _pack_case(
    src_dtype: torch.dtype, dst_dtype: torch.dtype, threads: int
) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(src_dtype) for s in _bucket_shapes()]
    offsets, size = hp_kernels.offsets_of(tensors)
    flat = torch.empty(size, dtype=dst_dtype)
    views = [
        flat.narrow(0, o, t.numel()).view(t.shape) for t, o in zip(tensors, offsets, strict=True)
    ]
    outs = [torch.empty_like(t) for t in tensors]
    packed = {
        "ref loop": lambda: reference.pack(tensors, flat, offsets),
        "ref foreach": lambda: torch._foreach_copy_(views, tensors),
        "hp_kernels": lambda: hp_kernels.pack(tensors, flat, offsets),
    }
    unpacked = {
        "ref loop": lambda: reference.unpack(flat, offsets, outs),
        "ref foreach": lambda: torch._foreach_copy_(outs, views),
        "hp_kernels": lambda: hp_kernels.unpack(flat, offsets, outs),
    }
    rows = []
    for op, variants, cast in (
        ("pack", packed, (src_dtype, dst_dtype)),
        ("unpack", unpacked, (dst_dtype, src_dtype)),
    ):
        t = _median_times(variants)
        rows.append(
            {
                "op": op,
                "threads": threads,
                "cast": f"{str(cast[0])[6:]}->{str(cast[1])[6:]}",
                "tensors": len(tensors),
                "elements": size,
                "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
                "ratio": round(min(t["ref loop"], t["ref foreach"]) / t["hp_kernels"], 3),
            }
        )
    return rows


def bench_pack(threads: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    rows = []
    for src_dtype, dst_dtype in (
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ):
        rows += _pack_case(src_dtype, dst_dtype, threads)
    return rows


def _ns_case(shape: tuple[int, ...], threads: int) -> dict[str, Any]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    coeffs = (3.4445, -4.7750, 2.0315)
    a, b, c = ([coeffs[i]] * 5 for i in range(3))
    t = _median_times(
        {
            "reference": lambda: reference.newton_schulz(x, a, b, c, 1e-7),
            "hp_kernels": lambda: hp_kernels.newton_schulz(x, 5, coeffs, 1e-7),
        }
    )
    return {
        "op": "newton_schulz",
        "threads": threads,
        "shape": list(shape),
        "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
        "ratio": round(t["reference"] / t["hp_kernels"], 3),
    }


def bench_newton_schulz(threads: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    return [_ns_case(shape, threads) for shape in [*NS_SHAPES, (256, 704)]]


def _comm_body() -> list[dict[str, Any]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(2)
    a_full = torch.randn(512 * world, 512, generator=g)
    b = torch.randn(512, 1024, generator=g)
    shard = a_full.chunk(world)[rank].contiguous()
    group = dist.group.WORLD
    assert group is not None
    name = group.group_name

    def by_hand_ag() -> torch.Tensor:
        return torch.matmul(funcol.wait_tensor(funcol.all_gather_single(shard, 0, name)), b)

    def by_hand_rs() -> torch.Tensor:
        out: torch.Tensor = funcol.wait_tensor(
            funcol.reduce_scatter_single(shard @ b, "sum", 0, name)
        )
        return out

    rows = []
    for op, variants in (
        (
            "all_gather_matmul",
            {"by hand": by_hand_ag, "hp_kernels": lambda: hp_kernels.all_gather_matmul(shard, b)},
        ),
        (
            "matmul_reduce_scatter",
            {
                "by hand": by_hand_rs,
                "hp_kernels": lambda: hp_kernels.matmul_reduce_scatter(shard, b),
            },
        ),
    ):
        # Time on every rank in lockstep; rank 0 reports.
        t = _median_times(variants)
        rows.append(
            {
                "op": op,
                "world": world,
                "ms": {k: round(v * 1e3, 3) for k, v in t.items()},
                "ratio": round(t["by hand"] / t["hp_kernels"], 3),
            }
        )
    return rows


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    thread_counts = sorted({1, cores})
    rows: list[dict[str, Any]] = []
    for threads in thread_counts:
        rows += bench_pack(threads)
        rows += bench_newton_schulz(threads)
    rows += run_local_ranks(2, _comm_body)
    print(
        f"machine: {platform.node()} {platform.machine()} {cores} cpus, torch {torch.__version__}, "
        f"backends {hp_kernels.available_backends()}"
    )
    print(f"{'op':<22} {'thr':>3} {'case':<26} {'times (ms)':<58} {'ratio':>6}")
    for r in rows:
        case = r.get("cast") or r.get("shape") or f"world {r.get('world')}"
        times = ", ".join(f"{k} {v}" for k, v in r["ms"].items())
        print(f"{r['op']:<22} {r.get('threads', 1):>3} {case!s:<26} {times:<58} {r['ratio']:>6}")
    print("ratio = best reference time / hp_kernels time (> 1: hp_kernels is faster)")
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "kernels",
                "machine": platform.node(),
                "cpus": cores,
                "torch": torch.__version__,
                "backends": hp_kernels.available_backends(),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
