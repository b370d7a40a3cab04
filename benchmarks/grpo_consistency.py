"""Benchmark: GRPO's consistency mode, its cost and the difference it removes, side by side in
one run at world 4.

Two GRPO runs of the same job (hp-train's Transformer, dim 128, 4 blocks, byte-level
vocabulary; FSDP 2 x TP 2 training, TP 2 x 2 rollout replicas on the same 4 CPU ranks; 32
prompts x 8 responses per step, 6 new tokens, 2 minibatches), one with ``consistency=True``
(the engine re-scores every rollout with an ordinary forward on the trainer's shapes), one
without (the engine's incremental KV-cache log-probabilities), stepped alternately so the
machine's drift weighs on both. Reported: the median step time of each and their ratio, and the
trainer's vs the behaviour log-probabilities over response tokens (largest and mean absolute
difference, before the first optimizer step of each batch) in each mode.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

import torch
from _machine import machine_line
from _ranks import run_local_ranks

WORLD = 4
STEPS = 8
WARMUP = 2


def _rank() -> dict[str, Any]:
    from hp_rl.config import RLConfig
    from hp_rl.trainer import GRPOTrainer
    from hp_train.config.schema import ModelConfig
    from hp_train.data.tokenizer import ByteTokenizer

    model = ModelConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=64
    )
    trainers = {}
    for mode in (False, True):
        config = RLConfig(
            tp=2, rollout_tp=2, prompts_per_step=32, group_size=8, max_new_tokens=6,
            minibatches=2, consistency=mode, out=tempfile.mkdtemp(),
        )  # fmt: skip
        trainers[mode] = GRPOTrainer(config, model, ByteTokenizer(), device=torch.device("cpu"))
    records: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for step in range(STEPS):
        for mode in (False, True) if step % 2 else (True, False):
            records[mode].append(trainers[mode].step(step))
    out = {}
    for mode, rows in records.items():
        timed = rows[WARMUP:]
        out[mode] = {
            "step_s": statistics.median(r["rollout_s"] + r["train_s"] for r in timed),
            "rollout_s": statistics.median(r["rollout_s"] for r in timed),
            "diff_max": max(r["logprob_diff_max"] for r in rows),
            "diff_mean": statistics.mean(r["logprob_diff_mean"] for r in rows),
        }
    return out


def main() -> None:
    print(machine_line())
    result = run_local_ranks(WORLD, _rank)
    for mode, name in ((False, "incremental"), (True, "consistency")):
        r = result[mode]
        print(
            f"{name:<12} step {r['step_s'] * 1e3:7.1f} ms (rollout {r['rollout_s'] * 1e3:6.1f} ms)"
            f" | logprob diff max {r['diff_max']:.3e}, mean {r['diff_mean']:.3e}"
        )
    ratio = result[True]["step_s"] / result[False]["step_s"]
    print(f"consistency / incremental step time: {ratio:.3f}x")


if __name__ == "__main__":
    main()
