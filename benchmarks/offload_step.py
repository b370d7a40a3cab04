"""Benchmark: training-step time with and without optimizer-state and parameter offload.

A Llama-style model (``hp_testing.llama``) trains on one process. Variants, each its own copy
of the model, timed in interleaved rounds (order rotated per round):

* ``resident``: plain AdamW (or ``torch.optim.Muon`` on the matrices + AdamW on the rest);
* ``opt offload``: the same optimizer(s) under ``hp_offload.OffloadedOptimizer`` (state in
  host memory, streamed in buckets of ``BUCKET_BYTES``);
* ``param offload``: ``hp_offload.offload_parameters(prefetch=1)``; the optimizer steps the
  host-resident parameters directly;
* ``both``: parameter offload and ``OffloadedOptimizer(stream_parameters=True)`` (parameters,
  gradients and state all stream through the device in the optimizer step).

A step is forward + backward + optimizer step. Reported: median step time over rounds, the
ratio to ``resident`` and the bytes each step copies host->device and device->host. On a
machine without an accelerator "device" and "host" are both CPU memory, so the ratios measure
the offload machinery itself (hooks, bucketing, the extra copies) with no overlap to win; on
an accelerator the copies run on a side stream behind compute. Compare ratios of one run.

Run: ``nox -s bench -- offload_step.py`` (or ``python benchmarks/offload_step.py`` with the
packages importable).
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
import torch.nn.functional as F
from _machine import machine_line
from torch import nn

from hp_offload import OffloadedOptimizer, offload_parameters
from hp_offload.streams import default_device
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=512, dim=256, n_layers=4, n_heads=8, ffn_dim=688, max_seq_len=64)
BATCH, SEQ = 4, 64
BUCKET_BYTES = 4 * 2**20
ROUNDS, WARMUP = 7, 2

Optimizers = list[torch.optim.Optimizer]


def _model(device: torch.device) -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG).to(device)


def _optimizers(model: nn.Module, kind: str) -> Optimizers:
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-3)]


class _Variant:
    def __init__(self, device: torch.device, kind: str, offload_opt: bool, offload_params: bool):
        self.device = device
        self.model = _model(device)
        self.handle = offload_parameters(self.model, device=device) if offload_params else None
        opts = _optimizers(self.model, kind)
        self.opts: list[torch.optim.Optimizer | OffloadedOptimizer] = (
            [
                OffloadedOptimizer(
                    o, bucket_bytes=BUCKET_BYTES, device=device, stream_parameters=offload_params
                )
                for o in opts
            ]
            if offload_opt
            else list(opts)
        )
        self.ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), device=device)

    def step(self) -> None:
        for opt in self.opts:
            opt.zero_grad()
        logits = self.model(self.ids)
        F.cross_entropy(logits.flatten(0, 1), self.ids.roll(-1, 1).flatten()).backward()
        for opt in self.opts:
            opt.step()

    def bytes_moved(self) -> tuple[int, int]:
        """(host->device, device->host) bytes of the last step."""
        h2d = d2h = 0
        if self.handle is not None:
            h2d, d2h = self.handle.stats.h2d_bytes, self.handle.stats.d2h_bytes
            self.handle.stats.reset()
        for opt in self.opts:
            if isinstance(opt, OffloadedOptimizer) and opt.last_step_stats is not None:
                h2d += opt.last_step_stats.h2d_bytes
                d2h += opt.last_step_stats.d2h_bytes
        return h2d, d2h


def _timed(step: Callable[[], None], device: torch.device) -> float:
    if device.type != "cpu":
        torch.accelerator.synchronize()
    start = time.perf_counter()
    step()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - start


def _bench(kind: str, device: torch.device) -> dict[str, Any]:
    variants = {
        "resident": _Variant(device, kind, False, False),
        "opt offload": _Variant(device, kind, True, False),
        "param offload": _Variant(device, kind, False, True),
        "both": _Variant(device, kind, True, True),
    }
    names = list(variants)
    for v in variants.values():
        for _ in range(WARMUP):
            v.step()
    times: dict[str, list[float]] = {n: [] for n in names}
    moved: dict[str, tuple[int, int]] = {}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            v = variants[name]
            v.bytes_moved()  # reset counters
            times[name].append(_timed(v.step, device))
            moved[name] = v.bytes_moved()
    ref = list(variants["resident"].model.parameters())
    for name in names[1:]:  # same steps, same data: the offloaded runs must match exactly
        got = list(variants[name].model.parameters())
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(ref, got, strict=True)), name
    med = {n: statistics.median(times[n]) for n in names}
    return {
        "median_s": med,
        "bytes_h2d": {n: moved[n][0] for n in names},
        "bytes_d2h": {n: moved[n][1] for n in names},
    }


def main() -> None:
    print(machine_line())
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    device = default_device()
    nparams = sum(p.numel() for p in Llama(CONFIG).parameters())
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch "
        f"{torch.__version__}, device {device}, {torch.get_num_threads()} threads; Llama "
        f"dim {CONFIG.dim}, {CONFIG.n_layers} blocks, {nparams / 1e6:.2f} M params, batch "
        f"{BATCH}x{SEQ}; bucket {BUCKET_BYTES >> 20} MiB; median of {ROUNDS} interleaved rounds"
    )
    results: dict[str, Any] = {}
    for kind in ("adamw", "muon"):
        res = _bench(kind, device)
        results[kind] = res
        med = res["median_s"]
        print(f"\noptimizer: {kind}")
        print(f"{'variant':<15}{'step ms':>10}{'x resident':>12}{'MiB h2d':>10}{'MiB d2h':>10}")
        for name, t in med.items():
            print(
                f"{name:<15}{t * 1e3:>10.1f}{t / med['resident']:>12.2f}"
                f"{res['bytes_h2d'][name] / 2**20:>10.2f}{res['bytes_d2h'][name] / 2**20:>10.2f}"
            )
    summary = {
        "benchmark": "offload_step",
        "device": str(device),
        "torch": torch.__version__,
        "params": nparams,
        **{
            f"{kind}_{name.replace(' ', '_')}_x_resident": round(
                r["median_s"][name] / r["median_s"]["resident"], 3
            )
            for kind, r in results.items()
            for name in r["median_s"]
            if name != "resident"
        },
        **{
            f"{kind}_{name.replace(' ', '_')}_ms": round(r["median_s"][name] * 1e3, 2)
            for kind, r in results.items()
            for name in r["median_s"]
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
