"""Benchmark: activation memory and step time of hp-offload's wrappers on a Llama stack.

One training step (forward, backward) of a Llama-style model (``LAYERS`` blocks, width
``DIM``, ``SEQ`` tokens x ``BATCH``) with each block wrapped by:

* ``plain``: nothing (the reference);
* ``torch ckpt``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` per block;
* ``hp full``: ``checkpoint_wrapper`` recomputing everything;
* ``hp save mm+attn``: ``checkpoint_wrapper`` saving matmul and attention outputs;
* ``hp budget``: ``checkpoint_wrapper(BudgetPolicy(...))`` with a quarter of a plain block's
  saved bytes per block;
* ``hp swap``: ``swap_wrapper`` (every saved activation to host);
* ``hp combo``: save attention, swap matmul outputs, recompute the rest.

Memory: bytes held for backward at the end of the forward, counted by
``hp_offload.memory.ActivationMeter`` (device and host separately; parameters excluded), and on
an accelerator the allocator peak of the step above the model's own memory. Time: the median
over ``ROUNDS`` interleaved rounds (order rotated per round) of the step time, and its ratio to
``plain``. Gradients of every variant are checked bit-equal to ``plain``'s.

Run: ``python benchmarks/activation_memory.py`` (with hp-offload and hp-testing importable).
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
from _machine import machine_line
from torch import nn
from torch.utils.checkpoint import checkpoint

from hp_offload.checkpoint import checkpoint_wrapper
from hp_offload.memory import ActivationMeter
from hp_offload.policy import ActivationPolicy, BudgetPolicy
from hp_offload.swap import Swapper, swap_wrapper
from hp_testing.llama import Llama, LlamaConfig

LAYERS, DIM, HEADS, FFN, SEQ, BATCH, VOCAB = 4, 256, 8, 704, 128, 2, 512
ROUNDS, WARMUP = 5, 1


class _TorchCheckpoint(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.block, *args, use_reentrant=False)
        return out


def _device() -> torch.device:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc if acc is not None else torch.device("cpu")


def _model(device: torch.device) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, ffn_dim=FFN, max_seq_len=SEQ
    )
    return Llama(config).to(device)


def _variants(device: torch.device, block_bytes: int) -> dict[str, Callable[[Llama], None]]:
    def each(wrap: Callable[[nn.Module], object]) -> Callable[[Llama], None]:
        def apply(model: Llama) -> None:
            for layer in model.layers:
                wrap(layer)

        return apply

    def torch_ckpt(model: Llama) -> None:
        model.layers = nn.ModuleList(_TorchCheckpoint(b) for b in model.layers)

    def swap(model: Llama) -> None:
        sw = Swapper(device=device)
        for layer in model.layers:
            swap_wrapper(layer, sw)

    def combo(model: Llama) -> None:
        sw = Swapper(device=device)
        policy = ActivationPolicy.build(save=["attention"], swap=["matmul"])
        for layer in model.layers:
            checkpoint_wrapper(layer, policy, swapper=sw)

    selective = ActivationPolicy.build(save=["matmul", "attention"])
    return {
        "plain": lambda model: None,
        "torch ckpt": torch_ckpt,
        "hp full": each(checkpoint_wrapper),
        "hp save mm+attn": each(lambda m: checkpoint_wrapper(m, selective)),
        "hp budget": each(lambda m: checkpoint_wrapper(m, BudgetPolicy(block_bytes // 4))),
        "hp swap": swap,
        "hp combo": combo,
    }


def _step(model: Llama, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids).float().pow(2).mean().backward()


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _measure_memory(model: Llama, ids: torch.Tensor, device: torch.device) -> dict[str, int]:
    _step(model, ids)  # plans, pools
    model.zero_grad(set_to_none=True)
    _sync(device)
    base = torch.accelerator.memory_allocated() if device.type != "cpu" else 0
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats()
    with ActivationMeter(exclude=[*model.parameters(), *model.buffers()]) as meter:
        loss = model(ids).float().pow(2).mean()
        held = {"device": meter.live, "host": meter.live_host}
        loss.backward()
    _sync(device)
    alloc = torch.accelerator.max_memory_allocated() - base if device.type != "cpu" else 0
    return {**held, "allocator_peak": alloc}


def _bench() -> dict[str, Any]:
    device = _device()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    plain = _model(device)
    with ActivationMeter(exclude=[*plain.parameters(), *plain.buffers()]) as meter:
        out = plain.layers[0](plain.tok_embeddings(ids), plain.cos[:SEQ], plain.sin[:SEQ])
        block_bytes = meter.live
    del out
    models: dict[str, Llama] = {}
    for name, wrap in _variants(device, block_bytes).items():
        models[name] = _model(device)
        wrap(models[name])
    grads: dict[str, list[torch.Tensor]] = {}
    memory: dict[str, dict[str, int]] = {}
    for name, model in models.items():
        memory[name] = _measure_memory(model, ids, device)
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    equal = {
        n: all(torch.equal(a, b) for a, b in zip(g, grads["plain"], strict=True))
        for n, g in grads.items()
    }
    names = list(models)
    for name in names:
        for _ in range(WARMUP):
            _step(models[name], ids)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            _step(models[name], ids)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {
        "device": str(device),
        "block_bytes": block_bytes,
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "memory": memory,
        "grads_bit_equal": equal,
    }


def main() -> None:
    print(machine_line())
    started = time.perf_counter()
    result = _bench()
    med, mem = result["median_s"], result["memory"]
    ref_t, ref_m = med["plain"], mem["plain"]["device"]
    print(
        f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, device {result['device']}; "
        f"Llama {LAYERS} blocks, dim {DIM}, ffn {FFN}, {BATCH}x{SEQ} tokens, fp32; median of "
        f"{ROUNDS} interleaved rounds"
    )
    print(
        f"{'variant':<17}{'step ms':>9}{'x plain':>9}{'dev MiB':>9}{'x plain':>9}"
        f"{'host MiB':>10}{'alloc MiB':>11}{'grads ==':>10}"
    )
    for name, t in med.items():
        m = mem[name]
        print(
            f"{name:<17}{t * 1e3:>9.1f}{t / ref_t:>9.2f}{m['device'] / 2**20:>9.1f}"
            f"{m['device'] / ref_m:>9.2f}{m['host'] / 2**20:>10.1f}"
            f"{m['allocator_peak'] / 2**20:>11.1f}{result['grads_bit_equal'][name]!s:>10}"
        )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "activation_memory",
                "machine": platform.node(),
                "torch": torch.__version__,
                "device": result["device"],
                "config": {
                    "layers": LAYERS,
                    "dim": DIM,
                    "ffn": FFN,
                    "seq": SEQ,
                    "batch": BATCH,
                    "dtype": "float32",
                },
                "median_s": med,
                "time_ratio_vs_plain": {n: t / ref_t for n, t in med.items()},
                "held_bytes": mem,
                "device_bytes_ratio_vs_plain": {n: m["device"] / ref_m for n, m in mem.items()},
                "grads_bit_equal": result["grads_bit_equal"],
            }
        )
    )


if __name__ == "__main__":
    main()
