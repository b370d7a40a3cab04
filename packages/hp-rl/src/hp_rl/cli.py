"""``python -m hp_rl`` / ``hp-rl``: GRPO on the arithmetic task, under torchrun.

    python -m hp_rl prepare --out runs/arith            # corpus + tokenizer, no download
    torchrun --standalone --nproc-per-node 4 -m hp_rl \\
        --init-from runs/arith/sft_hf --tokenizer runs/arith/tokenizer --tp 2 --rollout-tp 2

Every field of :class:`hp_rl.config.RLConfig` is a flag (``--prompts-per-step``, ...), over a
``--config`` TOML file's ``[rl]`` table. Rank 0 prints one line per ``log_every`` steps and
writes ``<out>/metrics.jsonl`` (one record per step, evaluations included), with
``--tensorboard`` the same as TensorBoard events in ``<out>/tensorboard``, and, with
matplotlib, ``<out>/reward.png``.

``--eval-every N`` measures the held-out greedy accuracy of the rollout engine every N steps
and after the last; it syncs the engine's weights first (so the figure is the policy's at that
step whatever ``sync_every`` says).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hp_rl.config import RLConfig, RLConfigError, load_config
from hp_rl.events import EventLog, check_tensorboard
from hp_rl.roles import RolesError
from hp_rl.tasks.arithmetic import ArithmeticTask, train_tokenizer
from hp_rl.trainer import GRPOTrainer
from hp_train.checkpoint.hf import read_hf_config
from hp_train.config.presets import model_preset
from hp_train.config.schema import ConfigError, ModelConfig
from hp_train.data.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer
from hp_train.observe.errors import report_error
from hp_train.observe.metrics import MetricsWriter
from hp_train.observe.plot import write_curves
from hp_train.runtime import init_runtime, shutdown

__all__ = ["main", "prepare"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hp_rl", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="a TOML file whose [rl] table sets the fields")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoints")
    p.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    for f in fields(RLConfig):
        default = f.default if f.default is not MISSING else None
        help_text = f"default {default!r}"
        if isinstance(default, bool):
            p.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_text)
        elif f.name == "operations":
            p.add_argument(_flag(f.name), help=f"comma-separated, {help_text}")
        elif f.name == "clip_eps_high":
            p.add_argument(_flag(f.name), type=float, help=help_text)
        elif f.name in ("init_from", "tokenizer"):
            p.add_argument(_flag(f.name), help=help_text)
        else:
            p.add_argument(_flag(f.name), type=type(default), help=help_text)
    return p


def prepare(out: Path, count: int, max_operand: int, seed: int) -> None:
    """The supervised warm-up's corpus (``<out>/corpus.jsonl``) and the tokenizer trained on
    it (``<out>/tokenizer``)."""
    task = ArithmeticTask(max_operand=max_operand)
    corpus = out / "corpus.jsonl"
    task.supervised_corpus(corpus, count, random.Random(seed))
    train_tokenizer(corpus, out / "tokenizer")
    print(f"hp-rl: wrote {count} problems to {corpus} and the tokenizer to {out / 'tokenizer'}")


def _prepare_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hp_rl prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=20_000, help="problems in the corpus")
    p.add_argument("--max-operand", type=int, default=99)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    prepare(a.out, a.count, a.max_operand, a.seed)
    return 0


def _model(config: RLConfig, tokenizer: TextTokenizer) -> tuple[ModelConfig, str | None]:
    if config.init_from is not None:
        return read_hf_config(config.init_from), config.init_from
    model = model_preset(config.model).model
    vocab = -(-tokenizer.vocab_size // config.tp) * config.tp
    return dataclasses.replace(model, vocab_size=vocab), None


def _line(record: dict[str, Any]) -> str:
    sync = "-" if record["sync_s"] is None else f"{record['sync_s'] * 1e3:.0f} ms"
    return (
        f"step {record['step']:>4} | reward {record['reward']:.3f} | len "
        f"{record['response_length']:.1f} | loss {record['loss']:+.4f} | kl {record['kl']:.4f} "
        f"| clip {record['clip_fraction']:.3f} | dlogp max {record['logprob_diff_max']:.2e} | "
        f"rollout {record['rollout_tokens_per_s']:.0f} tok/s | train "
        f"{record['train_tokens_per_s']:.0f} tok/s | sync {sync}"
    )


def run(config: RLConfig, resume: bool, device: str) -> int:
    """The GRPO run on an initialized runtime (every rank)."""
    runtime = init_runtime(device)
    tokenizer: TextTokenizer = (
        ByteTokenizer() if config.tokenizer is None else load_tokenizer(config.tokenizer)
    )
    model_config, weights = _model(config, tokenizer)
    trainer = GRPOTrainer(
        config, model_config, tokenizer, device=runtime.device, init_weights=weights
    )
    start = trainer.resume() if resume else 0
    out = Path(config.out)
    writer = None
    if runtime.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        writer = MetricsWriter(out / "metrics.jsonl")
        print(
            f"hp-rl: {trainer.roles.placement}, training {trainer.roles.dp_replicate}x"
            f"{trainer.roles.dp_shard}x{trainer.roles.tp} (dp_replicate x dp_shard x tp) on ranks "
            f"{list(trainer.roles.training_ranks)}, rollout {trainer.roles.rollout_groups} x tp "
            f"{trainer.roles.rollout_tp} on ranks {list(trainer.roles.rollout_ranks)}, sync "
            f"{config.sync_method}" + (f", resumed at step {start}" if start else "")
        )
    events = EventLog(out / "tensorboard") if config.tensorboard and writer is not None else None

    def record(entry: dict[str, Any]) -> None:
        if writer is not None:
            writer.write(entry)
        if events is not None:
            events.write(entry)

    rewards: list[tuple[float, float]] = []
    accuracy: list[tuple[float, float]] = []
    began = time.perf_counter()
    for step in range(start, config.steps):
        if config.eval_every and step % config.eval_every == 0:
            trainer.sync_weights(step)
            acc = trainer.evaluate(step)
            accuracy.append((step, acc))
            record({"step": step, "eval_accuracy": acc})
            if writer is not None:
                print(f"eval at step {step}: held-out greedy accuracy {acc:.3f}")
        metrics = trainer.step(step)
        rewards.append((step + 1, metrics["reward"]))
        record(metrics)
        if writer is not None and ((step + 1) % config.log_every == 0 or step + 1 == config.steps):
            print(_line(metrics), flush=True)
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            trainer.save(step + 1)
    if config.eval_every:
        trainer.sync_weights(config.steps)
        acc = trainer.evaluate(config.steps)
        accuracy.append((config.steps, acc))
        record({"step": config.steps, "eval_accuracy": acc})
        if writer is not None:
            print(f"eval at step {config.steps}: held-out greedy accuracy {acc:.3f}")
    if events is not None:
        events.close()
    if writer is not None:
        writer.close()
        series = {"mean reward (sampled)": rewards}
        if accuracy:
            series["held-out greedy accuracy"] = accuracy
        write_curves(out / "reward.png", series, title="GRPO", x_label="step", y_label="reward")
        print(f"hp-rl: {config.steps - start} steps in {time.perf_counter() - began:.1f} s")
    shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run; returns the exit code (2: bad configuration)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["prepare"]:
        return _prepare_main(args[1:])
    parsed = _parser().parse_args(args)
    overrides = {f.name: getattr(parsed, f.name) for f in fields(RLConfig)}
    try:
        config = load_config(parsed.config, overrides)
        if config.tensorboard:
            check_tensorboard()
        return run(config, parsed.resume, parsed.device)
    except (RLConfigError, RolesError, ConfigError) as exc:
        report_error(str(exc))
        if dist.is_initialized():
            shutdown()
        return 2
