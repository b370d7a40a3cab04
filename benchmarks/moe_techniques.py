"""Benchmark: step time, peak memory and activation bytes of the main job's memory and FP8
techniques on one MoE configuration at world 4 (CPU, gloo, one thread per rank).

The configuration (``COMMON``): a MoE decoder, dim 128, 4 blocks, every block a mixture of 8
experts (top-2, SwiGLU width 256), ``--ep 4`` over ``--dp-shard 4``, 8 sequences of 512 tokens
per step (2 per rank), synthetic data, Muon. Variants (``VARIANTS``): ``--ac none`` (the
reference of every ratio), ``--ac selective`` (matmul and attention outputs kept),
``--ac full``, ``--swap`` and ``--fp8 tensorwise``. On
CPU the FP8 matmuls are emulated (quantize to e4m3/e5m2, matmul in fp32), so FP8 costs time
here instead of saving it; its column shows the numerics, not the speed.

Two measurements:

* **The trainer** (``python -m hp_train`` under torchrun, ``--quiet``, ``--threads 1``):
  ``ROUNDS`` interleaved rounds (variant order rotated per round), each variant one run of
  ``STEPS`` steps. Step time: the median of the ``step_time_s`` records of ``metrics.jsonl``
  after the first two steps of each run, all rounds pooled. Peak memory: the last record's
  ``peak_rss_bytes`` per rank (on CPU the process's peak RSS: torch, the model, the
  optimizer and the data included; it cannot be reset, so it moves little). Losses: each
  step's global loss, checked bit-equal to ``--ac none`` for AC and swap, within
  ``FP8_LOSS_RTOL`` (relative, every step) for FP8.
* **Activation bytes held for backward**: the trainer does not report them, so the benchmark
  builds the same model in-process on 4 gloo ranks through hp-train's own functions (the CLI's
  ``parse``, ``build_layout``, ``Transformer``, ``parallelize``, ``build_data``, ``lm_loss``)
  and counts, at the end of one forward (after a warm-up step), what autograd and hp-offload's
  wrappers hold with ``hp_offload.memory.ActivationMeter`` (device and host separately;
  parameters, FSDP's unsharded ones included, excluded). Also the rise of the RSS peak over
  that step (``VmHWM`` reset through ``/proc/self/clear_refs``, minus ``VmRSS`` before it).

Run: ``python benchmarks/moe_techniques.py`` (with hp-train importable; about 10 minutes on
two cores; 12 with the five variants). Prints the machine, a table and one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _machine import machine_info, machine_line
from _ranks import run_local_ranks
from torch import nn

from hp_offload.memory import ActivationMeter, Place, Token

WORLD, STEPS, ROUNDS, SKIP = 4, 6, 2, 2
COMMON = [
    "--experts", "8", "--top-k", "2", "--expert-ffn-dim", "256", "--moe-every", "1",
    "--dim", "128", "--n-layers", "4", "--n-heads", "4", "--ffn-dim", "352",
    "--ep", "4", "--dp-shard", "4", "--seq-len", "512", "--global-batch", "8",
    "--data", "synthetic", "--steps", str(STEPS), "--log-every", "1000",
]  # fmt: skip
VARIANTS: dict[str, list[str]] = {
    "ac none": ["--ac", "none"],
    "ac selective": ["--ac", "selective"],
    "ac full": ["--ac", "full"],
    "swap": ["--swap"],
    "fp8 tensorwise": ["--fp8", "tensorwise"],
}
REFERENCE = "ac none"
EXACT = ("ac selective", "ac full", "swap")
#: FP8's losses against fp32's, relative, at every step (e4m3 forward, e5m2 gradients).
FP8_LOSS_RTOL = 2e-2
MIB = 2**20


class _ParameterFreeMeter(ActivationMeter):
    """An :class:`ActivationMeter` that also skips every ``nn.Parameter`` autograd saves
    (FSDP's unsharded parameters, gathered per block, are not in the exclude list)."""

    def hold(self, t: torch.Tensor, place: Place) -> Token | None:
        if isinstance(t, nn.Parameter):
            return None
        return super().hold(t, place)


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _held_bytes_rank() -> dict[str, list[Any]]:
    """Per variant, every rank's activation bytes (device, host) and RSS rise of one step."""
    from hp_train.config.cli import parse
    from hp_train.data.loader import build_data
    from hp_train.model.llama import Transformer, lm_loss
    from hp_train.parallel.parallelize import build_layout, parallelize
    from hp_train.trainer import data_spec, run_tokenizer

    out: dict[str, list[Any]] = {}
    for name, flags in VARIANTS.items():
        model_config, parallel, config, _, _ = parse([*COMMON, *flags], WORLD)
        layout = build_layout(parallel, "cpu")
        data = build_data(
            data_spec(config), run_tokenizer(config), seq_len=config.seq_len, seed=config.seed
        )
        torch.manual_seed(config.seed)
        model = Transformer(model_config)
        parallelize(model, layout, config=config)
        batch = data.batch(0, config.global_batch, layout.dp_rank, layout.dp_size)
        mine: dict[str, Any]
        try:  # a failure is the same on every rank (the same step of the same graph)
            lm_loss(model(batch.inputs), batch.targets).backward()  # warm-up: pools, plans
            model.zero_grad(set_to_none=True)
            rss_before = _proc_status_kib("VmRSS")
            reset = _reset_rss_peak()
            exclude = [*model.parameters(), *model.buffers()]
            with _ParameterFreeMeter(exclude=exclude) as meter:
                loss = lm_loss(model(batch.inputs), batch.targets)
                held = (meter.live, meter.live_host)
                loss.backward()
            rise = (_proc_status_kib("VmHWM") - rss_before) * 1024 if reset else None
            mine = {"device": held[0], "host": held[1], "rss_rise": rise}
        except RuntimeError as exc:
            mine = {"error": _first_line(str(exc))}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out[name] = gathered
        del model
    return out


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "?"


def _train(flags: list[str], out: Path) -> list[dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(WORLD), "-m", "hp_train", *COMMON, *flags,
        "--threads", "1", "--quiet", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error: " in line]
        raise RuntimeError(f"exit {done.returncode}: {_first_line(errors[0] if errors else '')}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _cli_rounds(
    root: Path,
) -> tuple[dict[str, list[list[dict[str, Any]]]], dict[str, str]]:
    """Every variant's runs (its metrics records per round); the variants that failed, with
    their error (not run again)."""
    names = list(VARIANTS)
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in failed:
                continue
            started = time.perf_counter()
            try:
                runs[name].append(_train(VARIANTS[name], root / f"{name.replace(' ', '_')}_{r}"))
                note = ""
            except RuntimeError as exc:
                failed[name] = str(exc)
                note = f" FAILED: {exc}"
            print(
                f"  round {r}: {name:<15} {time.perf_counter() - started:5.0f} s{note}", flush=True
            )
    return {n: v for n, v in runs.items() if n not in failed}, failed


def _summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    ref_losses = [[float(x["loss"]) for x in run] for run in runs[REFERENCE]]
    out: dict[str, dict[str, Any]] = {}
    for name, variant_runs in runs.items():
        times = [float(x["step_time_s"]) for run in variant_runs for x in run[SKIP:]]
        peaks = [
            max(int(run[-1]["peak_rss_bytes"][rank]) for run in variant_runs)
            for rank in range(WORLD)
        ]
        losses = [[float(x["loss"]) for x in run] for run in variant_runs]
        worst = max(
            abs(a - b) / abs(b)
            for mine, ref in zip(losses, ref_losses, strict=True)
            for a, b in zip(mine, ref, strict=True)
        )
        out[name] = {
            "median_step_s": statistics.median(times),
            "peak_rss_bytes": peaks,
            "losses": losses,
            "bit_equal": losses == ref_losses,
            "max_rel_loss_diff": worst,
        }
    return out


def _loss_verdict(name: str, s: dict[str, Any]) -> str:
    if name == REFERENCE:
        return "reference"
    if name in EXACT:
        return "bit-equal" if s["bit_equal"] else f"DIFFERS ({s['max_rel_loss_diff']:.1e})"
    ok = s["max_rel_loss_diff"] <= FP8_LOSS_RTOL
    return f"{'ok' if ok else 'OUT'} {s['max_rel_loss_diff']:.1e}"


def main() -> None:
    print(machine_line())
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}")
    print(f"config: {' '.join(COMMON)} (world {WORLD}, gloo, --threads 1)")
    print("FP8 on CPU is emulated (quantize, then an fp32 matmul): its time is not FP8's speed")
    started = time.perf_counter()
    print("activation bytes (in-process, 4 gloo ranks) ...", flush=True)
    held: dict[str, list[Any]] = run_local_ranks(WORLD, _held_bytes_rank)
    print(f"trainer runs ({ROUNDS} interleaved rounds x {len(VARIANTS)} variants):", flush=True)
    with tempfile.TemporaryDirectory(prefix="moe_techniques_") as tmp:
        runs, failed = _cli_rounds(Path(tmp))
    summary = _summarize(runs)
    ref = summary[REFERENCE]
    ref_held = max(h["device"] for h in held[REFERENCE])
    ref_deterministic = all(run == ref["losses"][0] for run in ref["losses"])
    print(
        f"\n{'variant':<15}{'step ms':>9}{'x none':>8}{'peak RSS MiB r0/r1/r2/r3':>27}"
        f"{'held dev MiB':>14}{'x none':>8}{'held host MiB':>15}{'RSS rise MiB':>14}"
        f"   losses vs ac none"
    )
    for name in VARIANTS:
        h = held[name]
        if "error" in h[0]:
            memory = f"{'failed':>14}{'':>8}{'':>15}{'':>14}"
        else:
            dev = max(x["device"] for x in h)
            host = max(x["host"] for x in h)
            rises = [x["rss_rise"] for x in h if x["rss_rise"] is not None]
            rise = f"{max(rises) / MIB:.0f}" if rises else "n/a"
            memory = f"{dev / MIB:>14.1f}{dev / ref_held:>8.2f}{host / MIB:>15.1f}{rise:>14}"
        if name in failed:
            print(f"{name:<15}{'failed':>9}{'':>8}{'':>27}{memory}   -")
            continue
        s = summary[name]
        peaks = "/".join(f"{p / MIB:.0f}" for p in s["peak_rss_bytes"])
        print(
            f"{name:<15}{s['median_step_s'] * 1e3:>9.0f}"
            f"{s['median_step_s'] / ref['median_step_s']:>8.2f}{peaks:>27}"
            f"{memory}   {_loss_verdict(name, s)}"
        )
    for name, error in failed.items():
        print(f"FAILED {name} ({' '.join(VARIANTS[name])}) in the trainer: {error}")
    for name, h in held.items():
        if "error" in h[0]:
            print(f"FAILED {name} in-process: {h[0]['error']}")
    print(
        f"\nstep time: median of steps {SKIP}..{STEPS - 1} of {ROUNDS} runs each; held: the "
        "largest rank's bytes saved for backward at the end of a forward (ActivationMeter); RSS "
        "rise: the largest rank's peak RSS over that step above its RSS before it; peak RSS: "
        "the trainer's peak_rss_bytes (whole process, max over rounds)"
    )
    print(
        f"losses: AC and swap must be bit-equal to ac none at every step; FP8 within relative "
        f"{FP8_LOSS_RTOL:g} at every step (shown: the largest relative difference); ac none "
        f"repeats bit-equal across rounds: {ref_deterministic}"
    )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "moe_techniques",
                "machine": machine_info(),
                "config": COMMON,
                "world": WORLD,
                "fp8_emulated": True,
                "median_step_s": {n: s["median_step_s"] for n, s in summary.items()},
                "time_ratio_vs_ac_none": {
                    n: s["median_step_s"] / ref["median_step_s"] for n, s in summary.items()
                },
                "peak_rss_bytes": {n: s["peak_rss_bytes"] for n, s in summary.items()},
                "held_bytes_per_rank": held,
                "losses": {n: s["losses"][0] for n, s in summary.items()},
                "bit_equal_vs_ac_none": {n: s["bit_equal"] for n, s in summary.items()},
                "max_rel_loss_diff": {n: s["max_rel_loss_diff"] for n, s in summary.items()},
                "ac_none_deterministic": ref_deterministic,
                "failed": failed,
            }
        )
    )


if __name__ == "__main__":
    main()
