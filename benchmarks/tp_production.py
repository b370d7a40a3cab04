"""Benchmark: tensor-parallel training step, production mode vs hand-written Megatron vs torch.

The same Llama (``hp_testing.llama.Llama``, same seed) with tensor parallelism 2 on two gloo
ranks, three ways:

* ``ours``: ``hp_dtensor.parallel.parallelize_module(model, mesh, plan, mode="production")``
  (plain local shards, planned collectives at module boundaries);
* ``megatron``: the model rebuilt by hand on plain local shards, with Megatron's two autograd
  functions (``f``: identity forward / all-reduce backward at each column-parallel input;
  ``g``: all-reduce forward / identity backward at each row-parallel output), a vocab-parallel
  embedding and an all-gather of the vocab-parallel logits -- the limit;
* ``torch``: ``torch.distributed.tensor.parallel.parallelize_module`` with torch's own styles
  (the same plan, torchtitan-like), DTensor parameters.

A training step is forward, cross-entropy on the replicated logits, backward and an AdamW step,
on the same batch every step. The first-step losses of the three must agree to 1e-5 and the
warm-up losses (after AdamW updates, so the gradients agree too) to 1e-4. After the warm-up,
each variant is timed in interleaved rounds (order rotated per round); the median over rounds of
the mean step time is reported (and the fastest round), for a tiny model (host overhead and
collective latency dominate) and a medium one, with the forward-only time (forward and loss
under no_grad) and the number of collectives per training step. This machine is noisy: compare
ratios of one run, and expect them to move by 0.1 between runs. Prints a table and one JSON
line.

Run: ``nox -s bench -- tp_production.py`` (or ``python benchmarks/tp_production.py`` with the
packages importable). ``--profile`` also prints a cProfile of ``ours`` on the tiny model
(rank 0).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import machine_line
from _ranks import run_local_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_testing.llama import Llama, LlamaConfig

WORLD = 2
LR = 1e-3
WARMUP = 3
LOSS_TOLERANCE = 1e-5  # first-step losses (same weights, same batch)
DRIFT_TOLERANCE = 1e-4  # warm-up losses after AdamW steps (checks the gradients too)
VARIANTS = ("ours", "megatron", "torch")


@dataclass(frozen=True)
class Size:
    """One model size and how long to time it."""

    name: str
    config: LlamaConfig
    batch: int
    seq: int
    rounds: int
    steps: int  # training steps per variant per round
    forwards: int  # forward-only calls per variant per round


SIZES = (
    Size(
        "tiny",
        LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16),
        batch=2,
        seq=16,
        rounds=15,
        steps=15,
        forwards=15,
    ),
    Size(
        "medium",
        LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, ffn_dim=704, max_seq_len=64),
        batch=4,
        seq=64,
        rounds=9,
        steps=5,
        forwards=4,
    ),
)


# ---------------------------------------------------------------------------------------------
# (a) ours: production mode
# ---------------------------------------------------------------------------------------------


def _ours(config: LlamaConfig) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_dtensor.parallel import parallelize_module, transformer_tp_plan
    from hp_layout import Mesh

    plan = transformer_tp_plan()
    mesh = DeviceMesh("cpu", Mesh((WORLD,), ("tp",)))
    torch.manual_seed(0)
    return parallelize_module(Llama(config), mesh, plan, mode="production", tp_axis="tp")


# ---------------------------------------------------------------------------------------------
# (c) torch.distributed.tensor.parallel
# ---------------------------------------------------------------------------------------------


def _torch(config: LlamaConfig) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": ColwiseParallel(),
        "layers.*.attn.v_proj": ColwiseParallel(),
        "layers.*.attn.o_proj": RowwiseParallel(),
        "layers.*.ffn.w1": ColwiseParallel(),
        "layers.*.ffn.w3": ColwiseParallel(),
        "layers.*.ffn.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    return parallelize_module(Llama(config), mesh, plan)


# ---------------------------------------------------------------------------------------------
# (b) Megatron by hand: plain local shards, f and g
# ---------------------------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce(sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out)
        return out


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce(sum) forward (in place), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _GatherLastDim(torch.autograd.Function):
    """All-gather of equal pieces along the last dim; backward keeps this rank's piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(), x.shape[-1]
        pieces = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(pieces, x.contiguous())
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous()


def _apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    # torch leaves Function.apply untyped.
    return cast(Callable[..., torch.Tensor], function.apply)


def _f(x: torch.Tensor) -> torch.Tensor:
    return _apply(_CopyToParallel)(x)


def _g(x: torch.Tensor) -> torch.Tensor:
    return _apply(_ReduceFromParallel)(x)


def _gather(x: torch.Tensor) -> torch.Tensor:
    return _apply(_GatherLastDim)(x)


def _shard(weight: torch.Tensor, dim: int) -> nn.Parameter:
    size = weight.shape[dim]
    if size % WORLD:
        raise ValueError(f"megatron variant needs sizes divisible by {WORLD}, got {size}")
    piece = weight.detach().chunk(WORLD, dim)[dist.get_rank()]
    return nn.Parameter(piece.clone())


def _whole(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight.detach().clone())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _MegatronBlock(nn.Module):
    """One pre-norm block: column-parallel q/k/v/w1/w3, row-parallel o/w2."""

    def __init__(self, block: nn.Module, config: LlamaConfig) -> None:
        super().__init__()
        attn, ffn = block.get_submodule("attn"), block.get_submodule("ffn")
        self.eps, self.head_dim = config.norm_eps, config.head_dim
        self.local_heads = config.n_heads // WORLD
        self.attn_norm = _whole(block.get_parameter("attn_norm.weight"))
        self.ffn_norm = _whole(block.get_parameter("ffn_norm.weight"))
        self.wq = _shard(attn.get_parameter("q_proj.weight"), 0)
        self.wk = _shard(attn.get_parameter("k_proj.weight"), 0)
        self.wv = _shard(attn.get_parameter("v_proj.weight"), 0)
        self.wo = _shard(attn.get_parameter("o_proj.weight"), 1)
        self.w1 = _shard(ffn.get_parameter("w1.weight"), 0)
        self.w3 = _shard(ffn.get_parameter("w3.weight"), 0)
        self.w2 = _shard(ffn.get_parameter("w2.weight"), 1)

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        x = _f(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = (
            heads(F.linear(x, self.wq)),
            heads(F.linear(x, self.wk)),
            heads(F.linear(x, self.wv)),
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _g(F.linear(out.transpose(1, 2).reshape(batch, seq, -1), self.wo))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = _f(x)
        return _g(F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self._attention(_rms_norm(x, self.attn_norm, self.eps), cos, sin)
        return h + self._mlp(_rms_norm(h, self.ffn_norm, self.eps))


class MegatronLlama(nn.Module):
    """``Llama`` on this rank's shards: vocab-parallel embedding, Megatron blocks, column-
    parallel LM head whose logits are all-gathered (replicated, as the plan's head)."""

    def __init__(self, full: Llama) -> None:
        super().__init__()
        config = full.config
        self.eps = config.norm_eps
        per_rank = config.vocab_size // WORLD
        self.vocab_start = dist.get_rank() * per_rank
        self.vocab_stop = self.vocab_start + per_rank
        self.embedding = _shard(full.tok_embeddings.weight, 0)
        self.layers = nn.ModuleList(_MegatronBlock(b, config) for b in full.layers)
        self.norm = _whole(full.norm.weight)
        self.head = _shard(full.output.weight, 0)
        self.register_buffer("cos", full.get_buffer("cos").clone(), persistent=False)
        self.register_buffer("sin", full.get_buffer("sin").clone(), persistent=False)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local_ids = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = F.embedding(local_ids, self.embedding)
        return _g(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._embed(ids)
        seq = ids.shape[1]
        cos, sin = self.get_buffer("cos")[:seq], self.get_buffer("sin")[:seq]
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = _f(_rms_norm(x, self.norm, self.eps))
        return _gather(F.linear(x, self.head))


def _megatron(config: LlamaConfig) -> nn.Module:
    torch.manual_seed(0)
    return MegatronLlama(Llama(config))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

Step = Callable[[], float]


def _trainer(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[Step, Step]:
    """(training step, forward-only step); each returns the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def loss_of() -> torch.Tensor:
        logits = model(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def train() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def forward() -> float:
        with torch.no_grad():
            return float(loss_of())

    return train, forward


def _per_call(fn: Step, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


class _CountCollectives(TorchDispatchMode):
    """Counts the collectives a step issues (c10d ops and torch's functional collectives)."""

    KINDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "alltoall")

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = str(func)
        if "c10d" in name and any(kind in name for kind in self.KINDS):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _collectives_per_step(train: Step) -> int:
    counter = _CountCollectives()
    with counter:
        train()
    return counter.count


def _bench_size(size: Size) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.config.vocab_size, (size.batch, size.seq), generator=g)
    targets = torch.randint(0, size.config.vocab_size, (size.batch, size.seq), generator=g)
    builders = {"ours": _ours, "megatron": _megatron, "torch": _torch}
    steps = {name: _trainer(build(size.config), ids, targets) for name, build in builders.items()}
    losses = {name: [train() for _ in range(WARMUP)] for name, (train, _) in steps.items()}
    first = {name: values[0] for name, values in losses.items()}
    spread = max(first.values()) - min(first.values())
    if spread > LOSS_TOLERANCE:
        raise AssertionError(f"{size.name}: first-step losses differ by {spread:.2e}: {first}")
    drift = max(
        abs(a - b)
        for i in range(WARMUP)
        for a in (v[i] for v in losses.values())
        for b in (v[i] for v in losses.values())
    )
    if drift > DRIFT_TOLERANCE:
        raise AssertionError(f"{size.name}: warm-up losses differ by {drift:.2e}: {losses}")
    collectives = {name: _collectives_per_step(train) for name, (train, _) in steps.items()}
    train_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    forward_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_index in range(size.rounds):
        # Rotate the order so that no variant always runs right after the same other one.
        shift = round_index % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            train, forward = steps[name]
            train_times[name].append(_per_call(train, size.steps))
            forward_times[name].append(_per_call(forward, size.forwards))
    return {
        "first_loss": first["ours"],
        "first_loss_spread": spread,
        "warmup_loss_spread": drift,
        "collectives_per_step": collectives,
        "train_ms": {n: statistics.median(v) * 1e3 for n, v in train_times.items()},
        "train_ms_min": {n: min(v) * 1e3 for n, v in train_times.items()},
        "forward_ms": {n: statistics.median(v) * 1e3 for n, v in forward_times.items()},
    }


def _profile_ours(size: Size) -> str:
    """cProfile (rank 0) of ``ours`` training steps on ``size``; every rank must call it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.config.vocab_size, (size.batch, size.seq), generator=g)
    targets = torch.randint(0, size.config.vocab_size, (size.batch, size.seq), generator=g)
    train, _ = _trainer(_ours(size.config), ids, targets)
    for _ in range(WARMUP):
        train()
    profiler = cProfile.Profile()
    dist.barrier()
    if dist.get_rank() == 0:
        profiler.enable()
    for _ in range(200):
        train()
    profiler.disable()
    if dist.get_rank() != 0:
        return ""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def _rank(profile: bool) -> tuple[dict[str, Any], str]:
    results = {size.name: _bench_size(size) for size in SIZES}
    profile_text = _profile_ours(SIZES[0]) if profile else ""
    return results, profile_text


def _print(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    header = (
        f"{'size':<8}{'ours ms':>9}{'meg ms':>9}{'torch ms':>10}{'ours/meg':>10}"
        f"{'torch/ours':>11}{'best o/m':>10}{'fwd o/m':>9}{'fwd t/o':>9}{'collectives o/m/t':>19}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name, r in results.items():
        t, best, fw = r["train_ms"], r["train_ms_min"], r["forward_ms"]
        colls = r["collectives_per_step"]
        row = {
            "size": name,
            "ours_ms": t["ours"],
            "megatron_ms": t["megatron"],
            "torch_ms": t["torch"],
            "ours_vs_megatron": t["ours"] / t["megatron"],
            "torch_vs_ours": t["torch"] / t["ours"],
            "best_ms": best,
            "best_ours_vs_megatron": best["ours"] / best["megatron"],
            "forward_ms": fw,
            "forward_ours_vs_megatron": fw["ours"] / fw["megatron"],
            "forward_torch_vs_ours": fw["torch"] / fw["ours"],
            "collectives_per_step": colls,
            "first_loss": r["first_loss"],
            "first_loss_spread": r["first_loss_spread"],
            "warmup_loss_spread": r["warmup_loss_spread"],
        }
        rows.append(row)
        counts = f"{colls['ours']}/{colls['megatron']}/{colls['torch']}"
        print(
            f"{name:<8}{t['ours']:>9.2f}{t['megatron']:>9.2f}{t['torch']:>10.2f}"
            f"{row['ours_vs_megatron']:>10.3f}{row['torch_vs_ours']:>11.2f}"
            f"{row['best_ours_vs_megatron']:>10.3f}{row['forward_ours_vs_megatron']:>9.3f}"
            f"{row['forward_torch_vs_ours']:>9.2f}{counts:>19}"
        )
    print(
        "ms: median over rounds of the mean step time; best: fastest round; fwd: forward + loss "
        "under no_grad; collectives: per training step (ours/megatron/torch)"
    )
    return rows


def main() -> None:
    print(machine_line())
    profile = "--profile" in sys.argv[1:]
    results, profile_text = run_local_ranks(WORLD, _rank, profile)
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"torch {torch.__version__}, {WORLD} gloo ranks, 1 thread each; "
        "ms per training step (forward + backward + AdamW), interleaved rounds"
    )
    rows = _print(results)
    print(
        json.dumps(
            {
                "benchmark": "tp_production",
                "machine": platform.node(),
                "torch": torch.__version__,
                "world": WORLD,
                "rows": rows,
            }
        )
    )
    if profile_text:
        print(profile_text)


if __name__ == "__main__":
    main()
