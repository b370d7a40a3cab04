"""Benchmark: hp-train's trainer vs torchtitan 0.3.0's on the same tokenized text, step for
step: tokens/s, step time, peak memory per rank, and both loss curves.

One run of each trainer of torchtitan's llama3 ``debugmodel`` shape -- dim 256, 6 layers, 16
heads, SwiGLU hidden 768, vocabulary 2048 (6,163,712 parameters, counted on both sides and
checked equal) -- in fp32, FSDP over 2 local gloo ranks (``dp_shard=2``, one thread each),
sequences of 256 tokens, 4 per rank (2,048 tokens per step), for 60 steps (``--steps``).

The text: a byte-level BPE of 2,048 tokens (:func:`hp_train.data.tokenizer.train_bpe`) is trained on
the training split of hp-train's built-in ``pydoc`` data (CPython's documentation topics,
10 % of the documents held out: ``training_texts(DataSpec(source="pydoc",
eval_fraction=0.1), seed=0)``) into a temporary folder. Both trainers are fed the batches of
hp-train's :class:`~hp_train.data.loader.TrainData` for that data and tokenizer: step ``s`` (from 0)
is ``TrainData.batch(s, global_batch=8, dp_rank, dp_size=2)`` on each rank. Every batch each
trainer takes is hashed (inputs and targets, per step and rank) and the script stops with an
error unless both trainers saw the same tokens at every step.

What runs is each trainer's own loop, configured through its own API:

* hp-train: :func:`hp_train.trainer.train` (what ``python -m hp_train`` runs) of the command
  line :func:`hp_train.config.cli.parse` reads from ``--data pydoc --tokenizer DIR
  --eval-fraction 0.1 --optimizer adamw --dp-shard 2`` and the sizes above; the rotary base
  is set to torchtitan's 500,000. The loss of every step is the global
  mean its ``Summary`` returns; learning rates and step times come from its ``metrics.jsonl``
  (``step_time_s``: batch, forward, loss, backward, optimizer step, zero_grad and the loss
  all-reduce). Its monitoring (gradient norms, per-layer update norms) runs on step 0 and the
  last step only; neither is timed.
* torchtitan: ``Trainer.train()`` of the registry's ``llama3_debugmodel`` config, built by
  ``benchmarks/_torchtitan_cpu.py`` (the run-time patches a CPU needs; SDPA instead of compiled
  FlexAttention, fp32, no activation checkpointing, no validation or checkpoints), with three
  components of this script: a dataloader serving the batches above, the tokenizer loaded by
  torchtitan's own ``HuggingFaceTokenizer`` from the same folder (its vocabulary is checked
  against hp-train's), and hp-train's learning-rate schedule (below). Its loss of every step
  is what its metrics logger receives (``log_freq=1``: the global mean loss torchtitan
  all-reduces itself); step time is the wall time of each ``Trainer.train_step`` (zero_grad,
  batch, forward, chunked cross-entropy, backward, gradient norm, optimizer and schedule step,
  the loss all-reduces and the log line).

Set equal where each trainer's API allows:

* AdamW (lr 8e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter) in
  torch's for-loop implementation on both: hp-train builds ``torch.optim.AdamW`` with its
  defaults (for-loop on CPU); torchtitan is told ``implementation="for-loop"`` (its default is
  ``fused``);
* the learning-rate schedule: hp-train's :func:`hp_train.optim.lr_factor` (linear warm-up over
  2 steps from 1/3 of the peak, then cosine decay to 0.1 x the peak at the last step), given to
  torchtitan as a scheduler component because its warmup-stable-decay cannot express it (its
  warm-up and decay are one step off hp-train's); the script stops with an error unless the
  learning rates of every step are equal;
* no gradient clipping: hp-train does not clip; torchtitan's ``max_norm`` is set to infinity,
  so its clip coefficient is 1 and the gradients are unchanged (it still computes the norm,
  part of its loop);
* the loss: token-mean cross-entropy over the global batch.

Not equal: the initial weights (each trainer initializes its own model from seed 0 with its
own scheme, so the curves start apart and their difference measures that and the numerics
together), the model code, the FSDP implementations and the loss kernel (torchtitan's chunked
cross-entropy).

Peak memory is the same measure for both: :func:`hp_train.observe.metrics.peak_memory_bytes` on the
CPU, the peak resident set size of each rank's process (``ru_maxrss``: all of the process's
memory, which cannot be reset). So each trainer runs in fresh rank processes of its own
(hp-train first, then torchtitan); the table also gives each rank's peak before the trainer
started (the process after importing torch, this script and hp-train's command line, which
both sides use) and the growth over it.

``tokens/s`` is global tokens per step / the median step time over steps ``WARMUP`` to
``STEPS - 2`` (the first steps warm up; hp-train's last step is monitored); the table adds the
10th-percentile and the fastest of those steps (the least disturbed ones on a loaded machine).
The loss curves are printed at every ``EVERY``-th step with their difference; the largest
``|hp - torchtitan|`` over all steps is reported with its step; ``--plot`` draws them. The two
runs follow one another (they are not interleaved: each is one run of its trainer's own loop),
so a change of the machine's load between them moves the ratios. This machine is shared and
noisy (2 cores): compare the ratios of one run, not absolute figures across runs.

Needs torchtitan 0.3.0 and what it imports (installed with ``--no-deps`` for hp-fsdp's
acceptance test, ``NO_DEPS_TEST_REQUIREMENTS`` in the noxfile); without them the script says
so and exits 0.

Run: ``nox -s bench -- train_text_vs_torchtitan.py`` (or, in the dev venv,
``OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= python benchmarks/train_text_vs_torchtitan.py``).
``--steps N`` changes the number of steps (default 60, at least ``WARMUP + 3``);
``--plot FILE.png`` also draws both loss curves (:func:`hp_train.observe.plot.write_curves`).
About 5 minutes on 2 busy cores (80 steps took 7 minutes under a load of 4 and 13 under a load
of 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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

from hp_testing.torchtitan_cpu import import_any

DP = 2
LR, WEIGHT_DECAY, LR_WARMUP_STEPS = 8e-4, 0.1, 2
ROPE_THETA = 500000.0  # torchtitan's llama3 rotary base
DATA, EVAL_FRACTION, SEED = "pydoc", 0.1, 0
DEFAULT_STEPS = 60
WARMUP = 3  # untimed steps at the start of each run
EVERY = 5  # the printed loss curves' stride
TRAINERS = ("torchtitan", "hp-train")
MIB = 2**20


# ---------------------------------------------------------------------------------------------
# The run, as hp-train's command line
# ---------------------------------------------------------------------------------------------


def hp_train_args(tokenizer: str, out: str, steps: int) -> list[str]:
    """hp-train's command line of the run (``python -m hp_train`` under torchrun, 2 ranks)."""
    return [
        "--data", DATA, "--tokenizer", tokenizer, "--eval-fraction", str(EVAL_FRACTION),
        "--optimizer", "adamw", "--dp-shard", str(DP),
        "--dim", str(DIM), "--n-layers", str(N_LAYERS), "--n-heads", str(N_HEADS),
        "--ffn-dim", str(FFN_DIM), "--vocab-size", str(VOCAB),
        "--seq-len", str(SEQ), "--global-batch", str(LOCAL_BATCH * DP), "--steps", str(steps),
        "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY),
        "--warmup-steps", str(LR_WARMUP_STEPS), "--seed", str(SEED),
        "--log-every", str(10 * steps), "--out", out, "--quiet",
    ]  # fmt: skip


def _parsed(args: list[str]) -> tuple[Any, Any, Any, Any]:
    """(model, parallel, train config, run options) of ``args``, the rotary base torchtitan's."""
    from hp_train.config.cli import parse

    model, parallel, config, options, _ = parse(args, DP)
    return dataclasses.replace(model, rope_theta=ROPE_THETA), parallel, config, options


# ---------------------------------------------------------------------------------------------
# What each trainer is fed: every TrainData.batch of the process, hashed
# ---------------------------------------------------------------------------------------------


def record_batches() -> dict[int, str]:
    """From now on in this process, every :meth:`hp_train.data.loader.TrainData.batch` call's result
    is hashed into the returned dict (step -> sha256 of inputs and targets); the batches
    themselves are unchanged."""
    from hp_train.data.loader import Batch, TrainData

    digests: dict[int, str] = {}
    serve = TrainData.batch

    @functools.wraps(serve)
    def batch(self: TrainData, step: int, *args: Any, **kwargs: Any) -> Batch:
        out = serve(self, step, *args, **kwargs)
        h = hashlib.sha256(out.inputs.numpy().tobytes())
        h.update(out.targets.numpy().tobytes())
        digests[step] = h.hexdigest()
        return out

    TrainData.batch = batch  # type: ignore[method-assign]
    return digests


def _gathered(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _start_peak() -> int:
    """The rank's peak before its trainer runs: after importing torch, this script and
    hp-train's command line (which imports hp-train's trainer), as both sides need."""
    import hp_train.config.cli  # noqa: F401

    return _peak()


def _peak() -> int:
    from hp_train.observe.metrics import peak_memory_bytes

    peak = peak_memory_bytes("cpu")
    if peak is None:
        raise RuntimeError("the peak resident set size is unknown here (no resource module)")
    return peak


# ---------------------------------------------------------------------------------------------
# hp-train's run (one rank; module level: pickled by name into the spawned ranks)
# ---------------------------------------------------------------------------------------------


def _hp_train_rank(tokenizer: str, folder: str, steps: int) -> dict[str, Any]:
    start_peak = _start_peak()
    from hp_train.model.llama import Transformer
    from hp_train.runtime import init_runtime
    from hp_train.trainer import train

    runtime = init_runtime("cpu", threads=1)  # keeps the group _ranks initialized
    model, parallel, config, options = _parsed(hp_train_args(tokenizer, folder, steps))
    digests = record_batches()
    began = time.perf_counter()
    summary = train(model, parallel, config, options, runtime)
    wall = time.perf_counter() - began
    peaks = _gathered({"start": start_peak, "peak": _peak(), "batches": digests})
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(model).parameters())
    result: dict[str, Any] = {"ranks": peaks, "params": params, "wall_s": wall}
    if runtime.rank == 0:
        records = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").open()]
        result["losses"] = [summary.losses[s] for s in range(steps)]
        result["step_s"] = [r["step_time_s"] for r in records]
        # lr by optimizer group name; the first group's, as torchtitan logs one.
        result["lrs"] = [next(iter(r["lr"].values())) for r in records]
        result["optimizer"] = "AdamW (for-loop: torch.optim.AdamW defaults on CPU)"
    return result


# ---------------------------------------------------------------------------------------------
# torchtitan's run: its components for hp-train's data and schedule
# ---------------------------------------------------------------------------------------------


def text_components(args: list[str]) -> tuple[Any, Any]:
    """A torchtitan dataloader serving hp-train's batches of the run ``args`` (hp-train's
    command line), and a torchtitan LR-scheduler config applying hp-train's schedule of it;
    torchtitan Configurables, to be built by its Trainer.

    The dataloader's ``i``-th batch (``i`` from 0; its checkpoint state) on data-parallel rank
    ``r`` of ``n`` is ``({"input": inputs}, targets)`` of ``TrainData.batch(i, global_batch,
    r, n)`` of :func:`hp_train.data.loader.build_data` for ``args``' data, tokenizer,
    ``seq_len`` and seed: the tokens hp-train's trainer takes at step ``i``.

    Raises (when built): ValueError where torchtitan's batch shape, step count or tokenizer
    vocabulary is not the one ``args`` give.
    """
    base_dataloader = import_any("torchtitan.components.dataloader").BaseDataLoader
    schedulers = import_any("torchtitan.components.optimizer.lr_scheduler")
    container = schedulers.LRSchedulersContainer
    frozen_args = tuple(args)

    class HpTrainDataLoader(base_dataloader):  # type: ignore[misc, valid-type]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(base_dataloader.Config):  # type: ignore[misc, name-defined]
            hp_train_args: tuple[str, ...] = frozen_args

        def __init__(
            self,
            config: Any,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            **kwargs: Any,
        ) -> None:
            from hp_train.data.loader import build_data
            from hp_train.trainer import data_spec, run_tokenizer

            _, _, train_config, _ = _parsed(list(config.hp_train_args))
            wanted = {
                "seq_len": train_config.seq_len,
                "global_batch": train_config.global_batch,
                "vocab": run_tokenizer(train_config).vocab_size,
            }
            found = {
                "seq_len": seq_len,
                "global_batch": local_batch_size * dp_world_size,
                "vocab": tokenizer.get_vocab_size(),
            }
            if found != wanted:
                raise ValueError(f"torchtitan asks for {found}; hp-train's run is {wanted}")
            self.data = build_data(
                data_spec(train_config), run_tokenizer(train_config),
                seq_len=train_config.seq_len, seed=train_config.seed,
            )  # fmt: skip
            self.global_batch = train_config.global_batch
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
            self.served = 0

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                batch = self.data.batch(
                    self.served, self.global_batch, self.dp_rank, self.dp_world_size
                )
                self.served += 1
                yield {"input": batch.inputs}, batch.targets

        # One key per rank: DCP keeps one copy of equal non-tensor keys across ranks.
        def state_dict(self) -> dict[str, Any]:
            return {f"served_rank_{self.dp_rank}": self.served, "world": self.dp_world_size}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if state_dict:
                if state_dict["world"] != self.dp_world_size:
                    raise ValueError(
                        f"the dataloader state is of {state_dict['world']} data-parallel "
                        f"ranks, this run has {self.dp_world_size}"
                    )
                self.served = int(state_dict[f"served_rank_{self.dp_rank}"])

    @dataclasses.dataclass(kw_only=True, slots=True)
    class HpTrainSchedule(container.Config):  # type: ignore[misc, name-defined]
        hp_train_args: tuple[str, ...] = frozen_args

        def build(self, *, optimizers: Any, training_steps: int) -> Any:
            from hp_train.optim import lr_factor

            _, _, train_config, _ = _parsed(list(self.hp_train_args))
            if training_steps != train_config.steps:
                raise ValueError(
                    f"torchtitan trains {training_steps} steps; hp-train's schedule is of "
                    f"{train_config.steps}"
                )
            return container(optimizers, functools.partial(lr_factor, config=train_config))

    return HpTrainDataLoader, HpTrainSchedule


def _configure(config: Any, args: list[str], tokenizer: str) -> None:
    loader_cls, schedule_cls = text_components(args)
    tokenizers = import_any("torchtitan.components.tokenizer")
    config.hf_assets_path = tokenizer
    config.tokenizer = tokenizers.HuggingFaceTokenizer.Config()
    config.dataloader = loader_cls.Config()
    config.lr_scheduler = schedule_cls(warmup_steps=LR_WARMUP_STEPS)
    config.metrics.log_freq = 1  # the global loss of every step
    config.training.max_norm = math.inf  # clip coefficient 1: no clipping
    config.optimizer.implementation = "for-loop"  # hp-train's torch.optim.AdamW on CPU


def _torchtitan_rank(tokenizer: str, folder: str, steps: int) -> dict[str, Any]:
    start_peak = _start_peak()
    args = hp_train_args(tokenizer, folder, steps)
    shape = TorchtitanShape(
        dim=DIM, n_layers=N_LAYERS, n_heads=N_HEADS, ffn_dim=FFN_DIM, vocab_size=VOCAB,
        seq_len=SEQ, local_batch=LOCAL_BATCH, dp_shard=DP, tp=1, lr=LR,
        weight_decay=WEIGHT_DECAY, warmup_steps=LR_WARMUP_STEPS, steps=steps, seed=SEED,
    )  # fmt: skip
    digests = record_batches()
    began = time.perf_counter()
    out = run_trainer(shape, folder, functools.partial(_configure, args=args, tokenizer=tokenizer))
    wall = time.perf_counter() - began
    peaks = _gathered({"start": start_peak, "peak": _peak(), "batches": digests})
    # torchtitan counts steps from 1.
    return {
        "ranks": peaks,
        "params": out["params"],
        "torchtitan_params": out["torchtitan_params"],
        "optimizer": out["optimizer"],
        "patched": out["patched"],
        "wall_s": wall,
        "losses": [out["losses"][s + 1] for s in range(steps)],
        "lrs": [out["lrs"][s + 1] for s in range(steps)],
        "step_s": [out["step_s"][s + 1] for s in range(steps)],
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _options(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per trainer")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of both loss curves")
    options = parser.parse_args(argv)
    if options.steps < WARMUP + 3:
        parser.error(
            f"--steps {options.steps}: at least {WARMUP + 3} ({WARMUP} warm-up steps, 2 timed "
            "and hp-train's monitored last step)"
        )
    if options.plot is not None and options.plot.suffix != ".png":
        parser.error(f"--plot {options.plot}: the plot is a PNG file, name it *.png")
    return options


def _plot(path: Path, runs: dict[str, dict[str, Any]]) -> None:
    from hp_train.observe.plot import write_curves

    series = {
        t: [(float(s + 1), loss) for s, loss in enumerate(runs[t]["losses"])] for t in TRAINERS
    }
    title = "training loss on pydoc (BPE 2048), FSDP over 2 ranks: hp-train vs torchtitan 0.3.0"
    if not write_curves(path, series, title=title, x_label="step", y_label="loss"):
        raise RuntimeError(f"--plot {path}: matplotlib is not installed, no plot written")
    print(f"plot: {path}")


def _train_tokenizer(folder: Path) -> tuple[str, float]:
    from hp_train.data.loader import DataSpec, training_texts
    from hp_train.data.tokenizer import train_bpe

    began = time.perf_counter()
    texts = training_texts(DataSpec(source=DATA, eval_fraction=EVAL_FRACTION), seed=SEED)
    train_bpe(texts, VOCAB, folder)
    return str(folder), time.perf_counter() - began


def check_same_batches(runs: dict[str, dict[str, Any]], steps: int) -> None:
    """Both trainers took the same tokens at every step on every rank.

    Raises:
        RuntimeError: a step a trainer did not take, or took other tokens of (the first named).
    """
    for rank in range(DP):
        seen = {t: runs[t]["ranks"][rank]["batches"] for t in TRAINERS}
        for step in range(steps):
            got = {t: seen[t].get(step) for t in TRAINERS}
            if None in got.values() or len(set(got.values())) != 1:
                raise RuntimeError(
                    f"rank {rank}, step {step}: the trainers took different batches "
                    f"(sha256 {got}); the comparison needs the same tokens"
                )


def check_same_lrs(runs: dict[str, dict[str, Any]]) -> None:
    """Both trainers stepped with the same learning rate at every step (the same schedule
    function times the same peak: equal to the last bit).

    Raises:
        RuntimeError: the first step where they differ.
    """
    pairs = zip(runs["hp-train"]["lrs"], runs["torchtitan"]["lrs"], strict=True)
    for step, (hp, tt) in enumerate(pairs):
        if hp != tt:
            raise RuntimeError(
                f"step {step}: learning rate {hp!r} in hp-train, {tt!r} in torchtitan; the "
                "comparison gives torchtitan hp-train's schedule"
            )


def _timed(step_s: list[float]) -> list[float]:
    return step_s[WARMUP:-1]


def _summary(runs: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    tokens = LOCAL_BATCH * DP * SEQ
    out: dict[str, Any] = {}
    for t in TRAINERS:
        step = statistics.median(_timed(runs[t]["step_s"]))
        ranks = runs[t]["ranks"]
        out[t] = {
            "tokens_per_s": tokens / step,
            "step_ms": 1e3 * step,
            "fastest_step_ms": 1e3 * min(_timed(runs[t]["step_s"])),
            "p10_step_ms": 1e3 * statistics.quantiles(_timed(runs[t]["step_s"]), n=10)[0],
            "peak_mib": [r["peak"] / MIB for r in ranks],
            "start_mib": [r["start"] / MIB for r in ranks],
            "growth_mib": [(r["peak"] - r["start"]) / MIB for r in ranks],
            "final_loss": runs[t]["losses"][-1],
            "wall_s": runs[t]["wall_s"],
        }
    hp, tt = runs["hp-train"]["losses"], runs["torchtitan"]["losses"]
    diffs = [h - t for h, t in zip(hp, tt, strict=True)]
    worst = max(range(steps), key=lambda s: abs(diffs[s]))
    out["loss_diffs"] = diffs
    out["max_abs_diff"] = {"value": abs(diffs[worst]), "step": worst}
    return out


def _print_report(runs: dict[str, dict[str, Any]], summary: dict[str, Any], steps: int) -> None:
    tt, hp = summary["torchtitan"], summary["hp-train"]
    timed = len(_timed(runs["hp-train"]["step_s"]))
    print(
        f"\nsteps {steps}: {WARMUP} warm-up, {timed} timed (steps {WARMUP}..{steps - 2}), "
        f"{LOCAL_BATCH * DP * SEQ} tokens per step"
    )
    print(f"{'':<28} {'torchtitan':>11} {'hp-train':>10} {'hp/tt':>7}")

    def row(name: str, a: float, b: float, fmt: str = ".0f") -> None:
        print(f"{name:<28} {a:>11{fmt}} {b:>10{fmt}} {b / a:>6.2f}x")

    row("tokens/s (median)", tt["tokens_per_s"], hp["tokens_per_s"])
    row("median step (ms)", tt["step_ms"], hp["step_ms"])
    row("10th-percentile step (ms)", tt["p10_step_ms"], hp["p10_step_ms"])
    row("fastest step (ms)", tt["fastest_step_ms"], hp["fastest_step_ms"])
    for r in range(DP):
        row(f"peak RSS rank {r} (MiB)", tt["peak_mib"][r], hp["peak_mib"][r])
    for r in range(DP):
        row(f"  growth over start, rank {r}", tt["growth_mib"][r], hp["growth_mib"][r])
    starts = ", ".join(
        f"{t} {'/'.join(f'{m:.0f}' for m in summary[t]['start_mib'])}" for t in TRAINERS
    )
    print(
        "peak RSS = ru_maxrss of each rank's process "
        "(hp_train.observe.metrics.peak_memory_bytes); "
        f"at the trainer's start (MiB, rank 0/1): {starts}"
    )
    print(f"\n{'step':>5} {'torchtitan':>11} {'hp-train':>10} {'hp - tt':>9}")
    shown = sorted({*range(0, steps, EVERY), steps - 1})
    for s in shown:
        a, b = runs["torchtitan"]["losses"][s], runs["hp-train"]["losses"][s]
        print(f"{s + 1:>5} {a:>11.4f} {b:>10.4f} {b - a:>+9.4f}")
    worst = summary["max_abs_diff"]
    print(
        f"final loss: torchtitan {tt['final_loss']:.4f}, hp-train {hp['final_loss']:.4f}; "
        f"largest |hp - tt| {worst['value']:.4f} at step {worst['step'] + 1}"
    )
    print(
        "steps counted from 1; the loss of a step is before its update; the initial weights "
        "differ (each trainer's own init)"
    )


def main() -> None:
    print(f"{machine_line()}; gloo ranks with 1 thread each", flush=True)
    reason = unavailable_reason()
    if reason is not None:
        print(f"train_text_vs_torchtitan: skipped, {reason}", flush=True)
        return
    options = _options(sys.argv[1:])
    steps = options.steps
    print(
        f"model: dim {DIM}, {N_LAYERS} layers, {N_HEADS} heads, ffn {FFN_DIM}, vocab {VOCAB}; "
        f"fp32; FSDP over {DP} ranks, {LOCAL_BATCH}x{SEQ} tokens per rank; AdamW lr {LR}; "
        f"data {DATA} (eval fraction {EVAL_FRACTION}) through a {VOCAB}-token BPE; "
        f"{steps} steps per trainer",
        flush=True,
    )
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_text_tt_") as root:
        tokenizer, bpe_s = _train_tokenizer(Path(root) / "tokenizer")
        print(f"tokenizer: trained in {bpe_s:.1f} s", flush=True)
        for trainer, fn in (("hp-train", _hp_train_rank), ("torchtitan", _torchtitan_rank)):
            folder = os.path.join(root, trainer)
            os.makedirs(folder)
            runs[trainer] = run_local_ranks(DP, fn, tokenizer, folder, steps)
            print(f"  {trainer}: {runs[trainer]['wall_s']:.0f} s", flush=True)
    check_same_batches(runs, steps)
    check_same_lrs(runs)
    params = {t: runs[t]["params"] for t in TRAINERS}
    if params["torchtitan"] != params["hp-train"]:
        raise RuntimeError(f"the two models differ in size: {params}")
    print(
        f"parameters: {params['hp-train']:,} both (torchtitan's own count "
        f"{runs['torchtitan']['torchtitan_params']:,}); same tokens at all {steps} steps on "
        f"both ranks (sha256 per batch), same learning rate at every step"
    )
    optimizers = {t: runs[t]["optimizer"] for t in TRAINERS}
    print(f"optimizers: torchtitan {optimizers['torchtitan']}, hp-train {optimizers['hp-train']}")
    summary = _summary(runs, steps)
    _print_report(runs, summary, steps)
    if options.plot is not None:
        _plot(options.plot, runs)
    print(f"wall {time.perf_counter() - started:.0f} s (this machine is shared with other work)")
    print(
        json.dumps(
            {
                "benchmark": "train_text_vs_torchtitan",
                "machine": machine_info(),
                "torchtitan": TORCHTITAN_VERSION,
                "config": {
                    **debug_shape(),
                    "dp_shard": DP,
                    "dtype": "float32",
                    "lr": LR,
                    "weight_decay": WEIGHT_DECAY,
                    "lr_warmup_steps": LR_WARMUP_STEPS,
                    "rope_theta": ROPE_THETA,
                    "data": DATA,
                    "eval_fraction": EVAL_FRACTION,
                    "steps": steps,
                    "untimed_warmup_steps": WARMUP,
                },
                "params": params,
                "optimizers": optimizers,
                "patched": runs["torchtitan"]["patched"],
                "tokenizer_train_s": round(bpe_s, 2),
                "lrs": runs["hp-train"]["lrs"],  # both trainers' (checked equal)
                "trainers": {
                    t: {
                        **{k: _rounded(v) for k, v in summary[t].items()},
                        "losses": [round(x, 5) for x in runs[t]["losses"]],
                        "step_ms_each": [round(1e3 * x, 2) for x in runs[t]["step_s"]],
                    }
                    for t in TRAINERS
                },
                "ratios_hp_over_tt": {
                    "tokens_per_s": round(
                        summary["hp-train"]["tokens_per_s"] / summary["torchtitan"]["tokens_per_s"],
                        3,
                    ),
                    "peak_memory": [
                        round(h / t, 3)
                        for h, t in zip(
                            summary["hp-train"]["peak_mib"],
                            summary["torchtitan"]["peak_mib"],
                            strict=True,
                        )
                    ],
                },
                "loss_diff_hp_minus_tt": [round(x, 5) for x in summary["loss_diffs"]],
                "max_abs_loss_diff": {
                    "value": round(summary["max_abs_diff"]["value"], 5),
                    "step": summary["max_abs_diff"]["step"] + 1,
                },
                "same_batches": True,
                "same_lrs": True,
            }
        )
    )


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
