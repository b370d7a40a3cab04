"""Benchmark: training tokens/s of hp-train's trainer vs torchtitan 0.3.0's, side by side.

Both trainers train torchtitan's llama3 ``debugmodel`` shape -- dim 256, 6 layers, 16 heads,
SwiGLU hidden 768, vocabulary 2048 (6,163,712 parameters, counted on both sides and checked
equal) -- on sequences of 256 tokens, 4 sequences per data-parallel rank, in fp32, on local
gloo ranks of this machine with one thread each, in two layouts:

* ``FSDP w2``: world 2, ``dp_shard=2``;
* ``FSDP x TP 2x2``: world 4, ``dp_shard=2 x tp=2`` (tensor parallelism on neighbouring ranks).

What runs is each trainer's own loop, configured through its own API:

* hp-train: :func:`hp_train.trainer.train` (what ``python -m hp_train`` runs) with
  ``--optimizer adamw --data synthetic``; its per-step times come from its ``metrics.jsonl``
  (``step_time_s``: batch, forward, loss, backward, optimizer step, zero_grad and the loss
  all-reduce). Its monitoring (gradient norms, per-layer update norms) runs on step 0 and the
  last step only (``log_every`` beyond the run); both are left out of the timed steps.
* torchtitan: ``Trainer.train()`` of the registry's ``llama3_debugmodel`` config, built by
  ``benchmarks/_torchtitan_cpu.py`` (the run-time patches a CPU needs, and the config
  overrides: SDPA for compiled FlexAttention, fp32, no activation checkpointing, no
  validation or checkpoints, synthetic batches); per-step time is the wall time of each
  ``Trainer.train_step`` (zero_grad, batch, forward, torchtitan's chunked cross-entropy,
  backward, gradient clipping, optimizer and LR-schedule step). Metrics are logged on step 1
  only (a warm-up step).

Same on both sides: AdamW (lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1), a 2-step
linear LR warm-up, token-mean cross-entropy, the same batch shape (2048 tokens per step); the
token ids are each side's own deterministic synthetic data (they do not change the cost).
Each trainer keeps its own choices otherwise (its AdamW implementation, its TP plan, its
gradient clipping: torchtitan clips to norm 1, hp-train does not clip); the JSON line records
the AdamW implementation each built.

One set of gloo rank processes per layout runs every round of both trainers, one trainer
after the other (a new model, optimizer and, for torchtitan, Trainer each time; garbage is
collected between runs, and the automatic garbage collection torchtitan's Trainer switches off
is switched back on after it). Start-up, model build and the first ``WARMUP`` steps of a run
are not timed; the next ``TIMED`` steps are. A run's figure is the median of its timed step
times; the runs are interleaved in rounds (the order of the two trainers alternates from round
to round and layout to layout), and the table shows the median over rounds of each side's
tokens/s (global tokens per step / step time), their ratio hp-train / torchtitan and the
per-round ratios. ``best`` is the ratio of the two fastest timed steps (each side's least
disturbed step: on a loaded machine, closer to what each would do alone). This machine is
shared and noisy: compare the ratios of one run, not absolute figures across runs.

Needs torchtitan 0.3.0 and what it imports (installed with ``--no-deps`` for hp-fsdp's
acceptance test, ``NO_DEPS_TEST_REQUIREMENTS`` in the noxfile); without them the script says
so and exits 0.

Run: ``nox -s bench -- train_vs_torchtitan.py`` (or, in the dev venv,
``OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= python benchmarks/train_vs_torchtitan.py``: with
byte-code writing off, every spawned rank compiles torch's and torchtitan's modules again).
``--rounds N`` changes the number of rounds (default 3). About 5-6 minutes on 2 busy cores.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _machine import machine_info, machine_line
from _ranks import run_local_ranks
from _torchtitan_cpu import (
    DIM,
    FFN_DIM,
    LOCAL_BATCH,
    N_HEADS,
    N_LAYERS,
    SEQ,
    TORCHTITAN_VERSION,
    VOCAB,
    TorchtitanShape,
    debug_shape,
    run_trainer,
    unavailable_reason,
)

LR, WEIGHT_DECAY, LR_WARMUP_STEPS = 8e-4, 0.1, 2
WARMUP, TIMED = 2, 8  # untimed and timed steps per run
DEFAULT_ROUNDS = 3
SEED = 0


@dataclass(frozen=True)
class Layout:
    """One parallel configuration."""

    name: str
    dp_shard: int
    tp: int

    @property
    def world(self) -> int:
        return self.dp_shard * self.tp

    @property
    def tokens_per_step(self) -> int:
        return self.dp_shard * LOCAL_BATCH * SEQ


LAYOUTS = (Layout("FSDP w2", dp_shard=2, tp=1), Layout("FSDP x TP 2x2", dp_shard=2, tp=2))
TRAINERS = ("torchtitan", "hp-train")


# ---------------------------------------------------------------------------------------------
# One rank of one run (module level: pickled by name into the spawned ranks)
# ---------------------------------------------------------------------------------------------


def _torchtitan_rank(layout: Layout, folder: str) -> dict[str, Any]:
    shape = TorchtitanShape(
        dim=DIM,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        ffn_dim=FFN_DIM,
        vocab_size=VOCAB,
        seq_len=SEQ,
        local_batch=LOCAL_BATCH,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=LR_WARMUP_STEPS,
        steps=WARMUP + TIMED,
        seed=SEED,
    )
    out = run_trainer(shape, folder)
    # torchtitan counts steps from 1.
    step_s = out.pop("step_s")
    warmup = [step_s[s] for s in range(1, WARMUP + 1)]
    timed = [step_s[s] for s in range(WARMUP + 1, WARMUP + TIMED + 1)]
    return {**out, "warmup_s": warmup, "timed_s": timed, "threads": torch.get_num_threads()}


def _hp_train_rank(layout: Layout, folder: str) -> dict[str, Any]:
    from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
    from hp_train.model.llama import Transformer
    from hp_train.runtime import init_runtime
    from hp_train.trainer import RunOptions, train

    runtime = init_runtime("cpu", threads=1)  # keeps the group _ranks initialized
    model = ModelConfig(
        vocab_size=VOCAB,
        dim=DIM,
        n_layers=N_LAYERS,
        n_heads=N_HEADS,
        n_kv_heads=N_HEADS,
        ffn_dim=FFN_DIM,
        max_seq_len=SEQ,
        rope_theta=500000.0,
    )
    parallel = ParallelConfig(dp_shard=layout.dp_shard, tp=layout.tp)
    steps = WARMUP + TIMED + 1  # the last step is monitored: not timed
    config = TrainConfig(
        steps=steps,
        global_batch=LOCAL_BATCH * parallel.dp,
        seq_len=SEQ,
        optimizer="adamw",
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        warmup_steps=LR_WARMUP_STEPS,
        data="synthetic",
        seed=SEED,
        log_every=10 * steps,  # monitors step 0 and the last step only
    )
    summary = train(model, parallel, config, RunOptions(out_dir=Path(folder), quiet=True), runtime)
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(model).parameters())
    result: dict[str, Any] = {
        "params": params,
        "optimizer": "AdamW (for-loop: torch.optim.AdamW defaults on CPU)",
        "first_loss": summary.losses[0],
        "threads": torch.get_num_threads(),
    }
    if runtime.rank == 0:
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").open()]
        by_step = {r["step"]: r["step_time_s"] for r in records}
        # metrics.jsonl counts steps from 1.
        result["warmup_s"] = [by_step[s + 1] for s in range(WARMUP)]
        result["timed_s"] = [by_step[s + 1] for s in range(WARMUP, WARMUP + TIMED)]
    return result


def _layout_rank(layout: Layout, root: str, rounds: int, first: int) -> list[dict[str, Any]]:
    """Every run of one layout on this rank: ``rounds`` rounds of both trainers, one after
    the other in these processes (the order alternates; ``first`` picks round 0's)."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = TRAINERS if (r + first) % 2 == 0 else TRAINERS[::-1]
        for trainer in order:
            folder = os.path.join(root, f"round{r}-{trainer}")
            if dist.get_rank() == 0:
                os.makedirs(folder)
            gc.collect()  # the previous run's garbage, not timed in this one
            dist.barrier()
            fn = _torchtitan_rank if trainer == "torchtitan" else _hp_train_rank
            began = time.perf_counter()
            result = fn(layout, folder)
            result.update(trainer=trainer, round=r, wall_s=time.perf_counter() - began)
            if "timed_s" in result:
                step = statistics.median(result["timed_s"])
                result.update(step_s=step, tokens_per_s=layout.tokens_per_step / step)
                if dist.get_rank() == 0:
                    print(
                        f"  round {r + 1}/{rounds} {layout.name:<14} {trainer:<10} "
                        f"{result['tokens_per_s']:8.0f} tokens/s (median step "
                        f"{step * 1e3:.0f} ms; warm-up steps "
                        f"{', '.join(f'{w * 1e3:.0f}' for w in result['warmup_s'])} ms; "
                        f"run {result['wall_s']:.0f} s)",
                        flush=True,
                    )
            runs.append(result)
    return runs


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _rounds_arg(argv: list[str]) -> int:
    if "--rounds" in argv:
        return max(1, int(argv[argv.index("--rounds") + 1]))
    return DEFAULT_ROUNDS


def _summarize(layout: Layout, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    tps = {t: [r["tokens_per_s"] for r in runs[t]] for t in TRAINERS}
    per_round = [h / t for t, h in zip(tps["torchtitan"], tps["hp-train"], strict=True)]
    tt, hp = statistics.median(tps["torchtitan"]), statistics.median(tps["hp-train"])
    fastest = {t: min(s for r in runs[t] for s in r["timed_s"]) for t in TRAINERS}
    return {
        "config": layout.name,
        "world": layout.world,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
        "tokens_per_step": layout.tokens_per_step,
        "torchtitan_tokens_per_s": round(tt, 1),
        "hp_train_tokens_per_s": round(hp, 1),
        "ratio": round(hp / tt, 3),
        "round_ratios": [round(r, 3) for r in per_round],
        "best_ratio": round(fastest["torchtitan"] / fastest["hp-train"], 3),
        "fastest_step_ms": {t: round(1e3 * fastest[t], 1) for t in TRAINERS},
        "torchtitan_round_tokens_per_s": [round(x, 1) for x in tps["torchtitan"]],
        "hp_train_round_tokens_per_s": [round(x, 1) for x in tps["hp-train"]],
        "torchtitan_step_ms": round(1e3 * layout.tokens_per_step / tt, 1),
        "hp_train_step_ms": round(1e3 * layout.tokens_per_step / hp, 1),
        "first_loss": {t: round(runs[t][0]["first_loss"], 4) for t in TRAINERS},
    }


def main() -> None:
    print(f"{machine_line()}; gloo ranks with 1 thread each", flush=True)
    reason = unavailable_reason()
    if reason is not None:
        print(f"train_vs_torchtitan: skipped, {reason}", flush=True)
        return
    rounds = _rounds_arg(sys.argv[1:])
    print(
        f"model: dim {DIM}, {N_LAYERS} layers, {N_HEADS} heads, ffn {FFN_DIM}, vocab {VOCAB}; "
        f"fp32; {LOCAL_BATCH}x{SEQ} tokens per data-parallel rank; AdamW lr {LR}; "
        f"{rounds} interleaved rounds, each run {WARMUP} warm-up + {TIMED} timed steps",
        flush=True,
    )
    started = time.perf_counter()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for i, layout in enumerate(LAYOUTS):
        with tempfile.TemporaryDirectory(prefix="bench_tt_") as root:
            done = run_local_ranks(layout.world, _layout_rank, layout, root, rounds, i)
        runs[layout.name] = {t: [run for run in done if run["trainer"] == t] for t in TRAINERS}

    first = {t: runs[LAYOUTS[0].name][t][0] for t in TRAINERS}
    params = {t: first[t]["params"] for t in TRAINERS}
    optimizers = {t: first[t]["optimizer"] for t in TRAINERS}
    print(
        f"parameters: torchtitan {params['torchtitan']:,} (its own count "
        f"{first['torchtitan']['torchtitan_params']:,}), hp-train {params['hp-train']:,}"
        + ("" if params["torchtitan"] == params["hp-train"] else "  <-- DIFFERENT MODEL SIZES")
    )
    print(f"optimizers: torchtitan {optimizers['torchtitan']}, hp-train {optimizers['hp-train']}")
    rows = [_summarize(layout, runs[layout.name]) for layout in LAYOUTS]
    header = f"{'config':<15} {'tokens/step':>11} {'torchtitan tok/s':>17} {'hp-train tok/s':>15}"
    print(f"\n{header} {'ratio':>6} {'best':>6}  per-round ratios")
    for row in rows:
        spread = " ".join(f"{x:.2f}" for x in row["round_ratios"])
        print(
            f"{row['config']:<15} {row['tokens_per_step']:>11} "
            f"{row['torchtitan_tokens_per_s']:>17.0f} {row['hp_train_tokens_per_s']:>15.0f} "
            f"{row['ratio']:>5.2f}x {row['best_ratio']:>5.2f}x  {spread}"
        )
    print(
        "ratio = hp-train / torchtitan tokens/s (medians over rounds), best = ratio of the "
        "fastest timed steps; goal >= 1.3x"
    )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "train_vs_torchtitan",
                "machine": machine_info(),
                "torchtitan": TORCHTITAN_VERSION,
                "config": {
                    **debug_shape(),
                    "dtype": "float32",
                    "lr": LR,
                    "weight_decay": WEIGHT_DECAY,
                    "warmup_steps": WARMUP,
                    "timed_steps": TIMED,
                    "rounds": rounds,
                },
                "params": params,
                "optimizers": optimizers,
                "patched": first["torchtitan"]["patched"],
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
