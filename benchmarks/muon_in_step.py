"""Benchmark: what Muon costs inside hp-train's step, by part, against the AdamW step.

``benchmarks/muon_share.py`` gives the least Muon can add from its FLOPs; this script measures
what it does add in the trainer. hp-train (:func:`hp_train.trainer.train`) trains torchtitan's
llama3 ``debugmodel`` shape (dim 256, 6 blocks, 16 heads, SwiGLU 768, vocabulary 2048; 4
sequences of 256 tokens per rank, fp32, synthetic data) with ``--dp-shard WORLD`` on local gloo
ranks of this machine, one thread each, once with ``--optimizer adamw`` and once with
``--optimizer muon`` per round (``ROUNDS`` rounds, the two alternated). On every rank, timers
wrap:

* ``Muon.step``: the whole Muon step (non-finite check, exchange, Newton-Schulz, update);
* the exchange (:func:`hp_muon.exchange.run_program`): gathers to the owners, Newton-Schulz
  on them, the scatter back (so it includes Newton-Schulz);
* Newton-Schulz alone (the optimizer's orthogonalize callback).

Printed per run: rank 0's median step time over steps 3 to ``STEPS - 1`` (from
``metrics.jsonl``; the first steps warm up, the last is monitored), and per rank the median
``Muon.step`` time and the per-step means of the exchange and of Newton-Schulz; then Muon's
share: the median ``Muon.step`` of the slowest rank over the median AdamW step. The ranks may
share fewer cores than there are ranks (4 ranks on 2 cores here): compare the figures of one run.

Run: ``nox -s bench -- muon_in_step.py`` (or ``python benchmarks/muon_in_step.py`` in the dev
venv); ``WORLD=2`` for two ranks. About 2 minutes at world 4 on 2 cores.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import machine_info, machine_line
from _ranks import run_local_ranks

WORLD = int(os.environ.get("WORLD", "4"))
ROUNDS = 2
STEPS = 8
TIMERS = ("muon_step", "exchange", "newton_schulz")


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out

    return run


def _rank(root: str) -> dict[str, list[dict[str, float]]]:
    import torch.distributed as dist

    import hp_muon.muon as muon_module
    from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
    from hp_train.runtime import init_runtime
    from hp_train.trainer import RunOptions, train

    runtime = init_runtime("cpu", threads=1)
    times: dict[str, list[float]] = {name: [] for name in TIMERS}
    step, orthogonalizer = muon_module.Muon.step, muon_module.Muon._orthogonalizer

    def timed_orthogonalizer(self: Any, *args: Any) -> Any:
        return _timed(times["newton_schulz"], orthogonalizer(self, *args))

    muon_module.Muon.step = _timed(times["muon_step"], step)  # type: ignore[method-assign]
    muon_module.Muon._orthogonalizer = timed_orthogonalizer  # type: ignore[method-assign]
    muon_module.run_program = _timed(times["exchange"], muon_module.run_program)
    model = ModelConfig(
        vocab_size=2048, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768,
        max_seq_len=256, rope_theta=500000.0,
    )  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(ROUNDS):
        order = ("adamw", "muon") if r % 2 == 0 else ("muon", "adamw")
        for optimizer in order:
            for record in times.values():
                record.clear()
            config = TrainConfig(
                steps=STEPS, global_batch=4 * WORLD, seq_len=256, optimizer=optimizer, lr=8e-4,
                weight_decay=0.1, warmup_steps=2, data="synthetic", seed=0,
                log_every=10 * STEPS,
            )  # fmt: skip
            folder = Path(root) / f"{optimizer}{r}"
            options = RunOptions(out_dir=folder, quiet=True)
            train(model, ParallelConfig(dp_shard=WORLD), config, options, runtime)
            mine: dict[str, float] = {}
            if runtime.rank == 0:
                lines = (folder / "metrics.jsonl").read_text().splitlines()
                step_s = [json.loads(line).get("step_time_s") for line in lines]
                mine["step_ms"] = statistics.median([s for s in step_s if s][2:-1]) * 1e3
            if times["muon_step"]:
                steps = len(times["muon_step"])
                mine["muon_step_ms"] = statistics.median(times["muon_step"][2:-1]) * 1e3
                mine["exchange_ms"] = sum(times["exchange"]) / steps * 1e3
                mine["newton_schulz_ms"] = sum(times["newton_schulz"]) / steps * 1e3
            every: list[dict[str, float]] = [{} for _ in range(WORLD)]
            dist.all_gather_object(every, mine)
            runs[f"{optimizer} round {r}"] = every
    return runs


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        runs = run_local_ranks(WORLD, _rank, root)
    print(f"{machine_line()}; world {WORLD}, one thread per rank; debugmodel shape, fp32")
    for name, ranks in runs.items():
        print(f"  {name}: step {ranks[0]['step_ms']:.0f} ms")
        for rank, figures in enumerate(ranks):
            if "muon_step_ms" in figures:
                print(
                    f"    rank {rank}: Muon.step {figures['muon_step_ms']:.1f} ms, exchange "
                    f"{figures['exchange_ms']:.1f} ms, Newton-Schulz "
                    f"{figures['newton_schulz_ms']:.1f} ms"
                )
    adamw = statistics.median(v[0]["step_ms"] for k, v in runs.items() if k.startswith("adamw"))
    muon = statistics.median(
        max(f["muon_step_ms"] for f in v) for k, v in runs.items() if k.startswith("muon")
    )
    print(f"  Muon.step (slowest rank) over the AdamW step: {100 * muon / adamw:.1f} %")
    print(
        json.dumps(
            {
                "benchmark": "muon_in_step",
                "machine": machine_info(),
                "world": WORLD,
                "runs": runs,
                "muon_share": muon / adamw,
            }
        )
    )


if __name__ == "__main__":
    main()
