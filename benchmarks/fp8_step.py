"""Benchmark: bytes on the wire and step time of FP8 training against bf16, in one run.

The model of hp-fsdp's must-show test (``packages/hp-fsdp/tests/test_fp8_training.py``):
``hp_testing.llama.Llama`` dim 64, 2 blocks, 4 heads, SwiGLU 128, vocab 128, 4 sequences of 32
tokens per rank; blocks sharded, then the root; AdamW. Variants, on gloo ranks of this machine
(one thread each):

* ``fp32``: no mixed precision;
* ``bf16``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the baseline of
  every ratio);
* ``fp8 linears only``: bf16 policy, the blocks' linears converted to ``hp_kernels.float8``
  FP8 linears (e4m3 forward, e5m2 gradients, dynamic tensorwise scales), bf16 all-gather;
* ``fp8 AG only``: bf16 policy and plain linears, the blocks' parameters all-gathered as
  block-scaled e4m3 (``LowPrecisionCommPolicy(param_all_gather_dtype=float8_e4m3fn)``, block
  128): the cost of the codec alone;
* ``fp8 lin + AG``: both (the configuration of the must-show test);
* ``fp8 lin + AG + bf16 RS``: also the gradient reduce-scatter with bf16 on the wire (fp32
  accumulation);
* ``fp8 lin + AG + e5m2 RS``: the reduce-scatter as block-scaled e5m2;
* world 4 only, ``HSDP bf16`` and ``HSDP fp8 lin + AG + bf16 AR``: mesh (replicate 2, shard 2),
  FP8 all-gather, fp32 reduce-scatter in the shard (fast) tier, bf16 all-reduce across the
  replicate (slow) tier.

The root (embedding, final norm, LM head) is all-gathered in bf16 in every bf16 variant, so the
all-gather column's ratio (0.56) mixes the blocks' FP8 records (0.516 of bf16) with the root's
bf16 bytes.

Bytes per step are counted with ``hp_fsdp.counting.CountingMode`` by purpose (parameter
all-gather, gradient reduce-scatter, gradient all-reduce, whatever primitive carries them):
*wire bytes* a rank sends under a bandwidth-optimal algorithm (``CollectiveCall.wire_bytes``).
Step time: after a warm-up, the variants run in interleaved rounds (order rotated per round);
reported: the median over rounds of the mean step time. Ratios are against ``bf16`` of the same
world. On CPU the FP8 matmuls are emulated (quantize, then a matmul in higher precision) and
the FP8 codecs run as several small kernels, so FP8 costs CPU time here rather than saving it;
what carries over to accelerators is the bytes column. Also reported: the mean loss of the
last 10 of ``TRAIN_STEPS`` training steps per variant (same data), against bf16.

This machine is noisy: compare the ratios of one run. Prints a table and one JSON line.
Run: ``nox -s bench -- fp8_step.py`` (or ``python benchmarks/fp8_step.py`` with the packages
importable).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import machine_line
from _ranks import run_local_ranks
from torch import nn

from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=32)
LOCAL_BATCH, SEQ = 4, 32
LR = 3e-3
WARMUP = 3
ROUNDS = 7
STEPS = 4  # timed steps per variant per round
TRAIN_STEPS = 100  # per variant, for the loss column
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Variant:
    """One way of training the model."""

    name: str
    mesh: tuple[int, ...]
    bf16: bool = True
    fp8_linears: bool = False  # the blocks' linears are FP8 linears
    fp8_gather: bool = False  # the blocks' parameters are all-gathered in FP8
    shard_wire: torch.dtype | None = None
    replicate_wire: torch.dtype | None = None


def _variants(world: int) -> tuple[Variant, ...]:
    flat = (world,)
    rows = [
        Variant("fp32", flat, bf16=False),
        Variant("bf16", flat),
        Variant("fp8 linears only", flat, fp8_linears=True),
        Variant("fp8 AG only", flat, fp8_gather=True),
        Variant("fp8 lin + AG", flat, fp8_linears=True, fp8_gather=True),
        Variant(
            "fp8 lin + AG + bf16 RS",
            flat,
            fp8_linears=True,
            fp8_gather=True,
            shard_wire=torch.bfloat16,
        ),
        Variant("fp8 lin + AG + e5m2 RS", flat, fp8_linears=True, fp8_gather=True, shard_wire=E5M2),
    ]
    if world == 4:
        rows += [
            Variant("HSDP bf16", (2, 2)),
            Variant(
                "HSDP fp8 lin + AG + bf16 AR",
                (2, 2),
                fp8_linears=True,
                fp8_gather=True,
                replicate_wire=torch.bfloat16,
            ),
        ]
    return tuple(rows)


def _is_block_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def _build(variant: Variant) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import LowPrecisionCommPolicy, MixedPrecisionPolicy, fully_shard
    from hp_layout import Mesh

    names = ("shard",) if len(variant.mesh) == 1 else ("replicate", "shard")
    mesh = DeviceMesh("cpu", Mesh(variant.mesh, names))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if variant.fp8_linears:
        from hp_kernels.float8 import convert_to_float8

        convert_to_float8(model, module_filter_fn=_is_block_linear)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if variant.bf16
        else MixedPrecisionPolicy()
    )
    block_comm = LowPrecisionCommPolicy(
        param_all_gather_dtype=E4M3 if variant.fp8_gather else None,
        shard_reduce_dtype=variant.shard_wire,
        replicate_reduce_dtype=variant.replicate_wire,
    )
    # The root all-gathers in bf16 and reduces like the blocks (the slow-tier all-reduce is
    # fused over all groups, so every group asks for the same replicate wire).
    root_comm = LowPrecisionCommPolicy(
        shard_reduce_dtype=variant.shard_wire, replicate_reduce_dtype=variant.replicate_wire
    )
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, comm_policy=block_comm)
    fully_shard(model, mesh=mesh, mp_policy=mp, comm_policy=root_comm)
    return model


def _chain() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.stack(
        [torch.randperm(CONFIG.vocab_size, generator=g)[:4] for _ in range(CONFIG.vocab_size)]
    )


def _batch(step: int, chain: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of ``step``: a fixed sparse Markov chain (4 successors per token)."""
    g = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
    tokens = torch.empty(LOCAL_BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, CONFIG.vocab_size, (LOCAL_BATCH,), generator=g)
    picks = torch.randint(0, 4, (LOCAL_BATCH, SEQ), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = chain[tokens[:, t], picks[:, t]]
    return tokens


def _trainer(model: nn.Module, chain: torch.Tensor) -> Callable[[int], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def train(step: int) -> float:
        tokens = _batch(step, chain)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(
            logits.float().reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return train


def _bytes(train: Callable[[int], float]) -> dict[str, dict[str, float]]:
    """Wire bytes of one step by purpose, in total and per mesh axis (this rank's groups)."""
    from hp_fsdp.counting import CountingMode

    with CountingMode() as counts:
        train(0)
    out: dict[str, dict[str, float]] = {"total": counts.bytes_by("purpose")}
    groups = {frozenset(c.ranks) for c in counts.collectives if c.purpose is not None}
    for ranks in sorted(groups, key=sorted):
        label = "+".join(map(str, sorted(ranks)))
        out[label] = counts.bytes_by("purpose", ranks)
    return out


def _mean_loss(variant: Variant, chain: torch.Tensor) -> float:
    train = _trainer(_build(variant), chain)
    losses = [train(step) for step in range(TRAIN_STEPS)]
    local = torch.tensor(sum(losses[-10:]) / 10)
    dist.all_reduce(local)
    return float(local) / dist.get_world_size()


def _bench_world(world: int) -> dict[str, Any]:
    variants = _variants(world)
    chain = _chain()
    trainers, counted = [], []
    for variant in variants:
        train = _trainer(_build(variant), chain)
        for step in range(WARMUP):
            train(step)
        counted.append(_bytes(train))
        trainers.append(train)
    times: list[list[float]] = [[] for _ in variants]
    order = list(range(len(variants)))
    for round_index in range(ROUNDS):
        shift = round_index % len(order)
        for index in order[shift:] + order[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for step in range(STEPS):
                trainers[index](WARMUP + step)
            times[index].append((time.perf_counter() - start) / STEPS)
    losses = [_mean_loss(v, chain) for v in variants]
    return {
        "rows": [
            {
                "variant": v.name,
                "mesh": list(v.mesh),
                "ms": statistics.median(t) * 1e3,
                "bytes": b,
                "final_loss": loss,
            }
            for v, t, b, loss in zip(variants, times, counted, losses, strict=True)
        ]
    }


def _run_world(world: int) -> dict[str, Any]:
    result: dict[str, Any] = run_local_ranks(world, _bench_world, world)
    return result


PURPOSES = ("param_all_gather", "grad_reduce_scatter", "grad_all_reduce")
SHORT = {"param_all_gather": "AG", "grad_reduce_scatter": "RS", "grad_all_reduce": "AR"}


def _table(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    header = (
        f"{'world':<6}{'variant':<28}{'ms':>8}{'x bf16':>8}"
        + "".join(f"{SHORT[p] + ' KiB':>9}{'x bf16':>8}" for p in PURPOSES)
        + f"{'loss':>8}{'- bf16':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for world, result in results.items():
        by = {r["variant"]: r for r in result["rows"]}
        for r in result["rows"]:
            base = by["HSDP bf16" if r["variant"].startswith("HSDP") else "bf16"]
            total, base_total = r["bytes"]["total"], base["bytes"]["total"]
            row = {
                "world": world,
                "variant": r["variant"],
                "mesh": r["mesh"],
                "ms": r["ms"],
                "ms_vs_bf16": r["ms"] / base["ms"],
                "bytes": r["bytes"],
                "bytes_vs_bf16": {
                    p: total.get(p, 0.0) / base_total[p] for p in PURPOSES if base_total.get(p)
                },
                "final_loss": r["final_loss"],
                "loss_minus_bf16": r["final_loss"] - base["final_loss"],
            }
            rows.append(row)
            cells = "".join(
                f"{total.get(p, 0.0) / 1024:>9.1f}"
                + (f"{row['bytes_vs_bf16'][p]:>8.3f}" if p in row["bytes_vs_bf16"] else f"{'':>8}")
                for p in PURPOSES
            )
            print(
                f"{world:<6}{r['variant']:<28}{r['ms']:>8.1f}{row['ms_vs_bf16']:>8.2f}{cells}"
                f"{r['final_loss']:>8.3f}{row['loss_minus_bf16']:>+8.3f}"
            )
    print(
        "ms: median over rounds of the mean step time (forward, backward, AdamW); KiB: wire "
        "bytes per step a rank sends (bandwidth-optimal algorithm), by purpose; x bf16: against "
        "the bf16 row of the same world and mesh; loss: mean of the last 10 of "
        f"{TRAIN_STEPS} steps"
    )
    return rows


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    results = {world: _run_world(world) for world in (2, 4)}
    c = CONFIG
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, gloo ranks with 1 thread each; Llama dim {c.dim}, "
        f"{c.n_layers} layers, ffn {c.ffn_dim}, vocab {c.vocab_size}; batch {LOCAL_BATCH}x{SEQ} "
        f"per rank; {ROUNDS} interleaved rounds of {STEPS} steps"
    )
    rows = _table(results)
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "fp8_step",
                "machine": platform.node(),
                "torch": torch.__version__,
                "config": {
                    "dim": c.dim,
                    "n_layers": c.n_layers,
                    "ffn_dim": c.ffn_dim,
                    "vocab_size": c.vocab_size,
                    "local_batch": LOCAL_BATCH,
                    "seq": SEQ,
                },
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
