"""Benchmark: the least Muon can add to a training step, from its compute alone.

Muon's Newton-Schulz iteration is compute that AdamW does not have: per ``m x n`` matrix
(``m <= n``, the iteration runs on the wide side) each of its ``steps`` iterations costs
``4 m^2 n + 2 m^3`` FLOPs (``A = X X^T``, ``B = b A + c A^2``, ``X = a X + B X``). hp-muon
spreads the matrices over the ranks (one owner each, balanced by that cost), so with perfect
balance and free communication each rank runs ``1 / world`` of it, while each rank's forward
and backward cost does not shrink with the world. That ratio is a floor on "Muon adds x % to the
step" that no overlap can remove on a machine whose cores are all busy computing (here one
thread per rank on a 2-core CPU: Newton-Schulz overlapped with backward would run on the same
core as backward).

Measured on one process with one thread (a rank), on torchtitan's llama3 ``debugmodel`` shape
that ``benchmarks/train_vs_torchtitan.py`` trains (dim 256, 6 blocks, 16 heads, SwiGLU 768,
vocabulary 2048; 4 sequences of 256 tokens per data-parallel rank), fp32:

* ``forward+backward``: the model's forward, cross-entropy and backward on one rank's batch;
* ``AdamW (all)``: ``torch.optim.AdamW`` with torch's default implementation, as hp-train runs
  it (the for-loop on the CPU, foreach on CUDA), over every parameter: the AdamW-only step's
  optimizer; ``AdamW (all, foreach)`` and ``AdamW (all, fused)`` beside it, the implementations
  hp-train does not pick on the CPU (foreach computes the loop's values bit for bit but is slower
  here; fused is faster but rounds differently, by about 2e-7);
* ``AdamW (rest)``: the same over what Muon + AdamW leaves to AdamW (embeddings, norms, head);
* ``Newton-Schulz (all)``: ``hp_muon.orthogonalize`` in bf16 (``torch.optim.Muon``'s
  iteration: 5 steps, Keller Jordan's coefficients) over every block matrix, one by one;
* ``Muon step (1 rank)``: ``hp_muon.Muon`` (momentum, Newton-Schulz, update) over the block
  matrices on one rank.

Printed: each time (median of ``REPEATS``), the FLOPs and achieved GFLOP/s of the model and of
Newton-Schulz, and for world 2 and 4 the floor of Muon's addition to the step: ``(Muon step /
world + AdamW (rest) - AdamW (all)) / (forward+backward + AdamW (all))``. One JSON line.

Run: ``nox -s bench -- muon_share.py`` (or ``python benchmarks/muon_share.py`` in the dev venv).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _machine import machine_info, machine_line

from hp_muon import KELLER, Muon, coefficient_schedule, split_params
from hp_muon.newton_schulz import orthogonalize
from hp_train.config.schema import ModelConfig
from hp_train.model.llama import Transformer

CONFIG = ModelConfig(
    vocab_size=2048, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, max_seq_len=256
)
BATCH, SEQ = 4, 256
NS_STEPS = 5
REPEATS = 7


def _median_ms(run: Callable[[], object]) -> float:
    run()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _ns_flops(shape: tuple[int, ...]) -> int:
    m, n = sorted(shape[-2:])
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    split = split_params(model)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1))

    def forward_backward() -> None:
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

    forward_backward()
    every = list(model.parameters())
    adamw_all = torch.optim.AdamW(every, lr=1e-4)
    adamw_foreach = torch.optim.AdamW(every, lr=1e-4, foreach=True)
    adamw_fused = torch.optim.AdamW(every, lr=1e-4, fused=True)
    adamw_rest = torch.optim.AdamW(split.adamw_params, lr=1e-4)
    muon = Muon(split.muon_params, lr=1e-4, adjust_lr_fn="match_rms_adamw")
    schedule = coefficient_schedule(KELLER, NS_STEPS)
    matrices = [p.grad.detach().clone() for p in split.muon_params if p.grad is not None]

    def newton_schulz() -> None:
        for g in matrices:
            orthogonalize(g, schedule, 1e-7, torch.bfloat16)

    times = {
        "forward+backward": _median_ms(forward_backward),
        "AdamW (all)": _median_ms(adamw_all.step),
        "AdamW (all, foreach)": _median_ms(adamw_foreach.step),
        "AdamW (all, fused)": _median_ms(adamw_fused.step),
        "AdamW (rest)": _median_ms(adamw_rest.step),
        "Newton-Schulz (all)": _median_ms(newton_schulz),
        "Muon step (1 rank)": _median_ms(muon.step),
    }
    non_embedding = sum(p.numel() for p in split.muon_params)
    tokens = BATCH * SEQ
    model_flops = 6 * tokens * (non_embedding + CONFIG.vocab_size * CONFIG.dim)
    model_flops += 12 * CONFIG.n_layers * BATCH * SEQ * SEQ * CONFIG.dim // 2  # causal attention
    ns_flops = sum(_ns_flops(tuple(m.shape)) for m in matrices)
    adamw_step = times["forward+backward"] + times["AdamW (all)"]
    floors = {}
    for world in (2, 4):
        added = times["Muon step (1 rank)"] / world + times["AdamW (rest)"] - times["AdamW (all)"]
        floors[world] = added / adamw_step
    print(f"{machine_line()}; one thread; debugmodel shape, {tokens} tokens per rank, fp32")
    for name, ms in times.items():
        print(f"  {name:22s} {ms:8.1f} ms")
    print(
        f"  model {model_flops / 1e9:.1f} GFLOP per rank-step "
        f"({model_flops / times['forward+backward'] / 1e6:.1f} GFLOP/s fp32); Newton-Schulz "
        f"{ns_flops / 1e9:.1f} GFLOP per step for the job "
        f"({ns_flops / times['Newton-Schulz (all)'] / 1e6:.1f} GFLOP/s bf16)"
    )
    for world, floor in floors.items():
        print(f"  world {world}: Muon adds at least {100 * floor:.1f} % to the AdamW step")
    print(
        json.dumps(
            {
                "benchmark": "muon_share",
                "machine": machine_info(),
                "ms": times,
                "model_gflop": model_flops / 1e9,
                "newton_schulz_gflop": ns_flops / 1e9,
                "floor_added_fraction": floors,
            }
        )
    )


if __name__ == "__main__":
    main()
