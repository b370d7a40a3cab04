"""``hp-train`` / ``python -m hp_train``: the command line of the training entry point.

Run it under torchrun, e.g. 4 local CPU ranks with FSDP x TP and Muon::

    torchrun --standalone --nproc-per-node 4 -m hp_train --dp-shard 2 --tp 2 --steps 20

``--dp-shard`` defaults to every rank the other dimensions leave. The same command runs on
GPUs (``--device cuda``) or NPUs (``--device npu``) and across hosts with torchrun's usual
flags.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from hp_train.checkpoint.dcp import CheckpointError
from hp_train.config.presets import model_configs
from hp_train.config.schema import (
    CP_VARIANTS,
    FP8_RECIPES,
    MIXED_PRECISIONS,
    OFFLOAD_TARGETS,
    PIPELINE_SCHEDULE_NAMES,
    ConfigError,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from hp_train.config.toml_file import option_tables, read_config_file, resolved_tables
from hp_train.observe.nonfinite import NonFiniteError
from hp_train.parallel.run_plan import plan_report
from hp_train.runtime import init_runtime, shutdown
from hp_train.trainer import RunOptions, Summary, train

__all__ = ["EXIT_CHECKPOINT", "EXIT_CONFIG", "EXIT_NONFINITE", "MODEL_PRESETS", "main", "parse"]

#: Named model sizes (``--model``; the one table the dry run uses too, ``hp_train.config.presets``);
#: explicit size flags override a preset's fields.
MODEL_PRESETS: dict[str, ModelConfig] = model_configs()


#: The tables of a ``--config`` file, by the argparse group whose options each holds.
_TABLES = {
    "model": "model",
    "parallelism (dp_replicate x dp_shard x cp x tp x pp = world size)": "parallel",
    "training": "training",
    "data": "data",
    "run": "run",
}


def _expert_note(parallel: ParallelConfig) -> str:
    if parallel.ep == 1:
        return ""
    return f" (ep={parallel.ep}{', experts over tp' if parallel.ep_tp else ''})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hp-train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML file of options (tables [model], [parallel], [training], [data], [run]; "
        "keys are the options' names with underscores); flags given here override it",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, choices=sorted(MODEL_PRESETS), help="default: tiny")
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-dim", "vocab-size"):
        m.add_argument(f"--{name}", type=int, default=None)
    m.add_argument("--experts", type=int, default=None, help="routed experts (makes it MoE)")
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--expert-ffn-dim", type=int, default=None)
    m.add_argument("--moe-every", type=int, default=2)
    m.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="a local Hugging Face checkpoint folder (config.json + safetensors; Llama, Qwen2, "
        "Qwen3): the model's architecture and starting weights",
    )
    d = p.add_argument_group("parallelism (dp_replicate x dp_shard x cp x tp x pp = world size)")
    d.add_argument("--dp-replicate", type=int, default=1)
    d.add_argument("--dp-shard", type=int, default=None, help="default: what is left")
    d.add_argument("--tp", type=int, default=1)
    d.add_argument("--pp", type=int, default=1, help="pipeline stages")
    d.add_argument("--cp", type=int, default=1, help="context parallel: split each sequence")
    d.add_argument("--cp-variant", default="ring", choices=CP_VARIANTS)
    d.add_argument(
        "--ep", type=int, default=1, help="expert parallel (MoE), carved from --dp-shard"
    )
    d.add_argument(
        "--ep-tp",
        action="store_true",
        help="with --ep and --tp: split each expert's hidden dim over tp too",
    )
    d.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step (default: pp; 1 without pipelining)",
    )
    d.add_argument("--pp-schedule", default="1f1b", choices=PIPELINE_SCHEDULE_NAMES)
    d.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    d.add_argument("--threads", type=int, default=None, help="CPU threads per rank")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--global-batch", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=32)
    t.add_argument("--optimizer", default="muon", choices=("muon", "adamw"))
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW peak lr")
    t.add_argument("--muon-lr", type=float, default=0.02, help="Muon peak lr")
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--warmup-steps", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--deterministic", action="store_true")
    t.add_argument("--log-every", type=int, default=5, help="precision monitoring interval")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    t.add_argument("--clip-grad-norm", type=float, default=0.0, help="max global norm (0: off)")
    t.add_argument(
        "--skip-nonfinite",
        type=int,
        default=0,
        help="skip up to N steps whose loss or gradients are NaN/inf (no optimizer step), then "
        "stop; 0: stop at the first (exit code 3)",
    )
    t.add_argument(
        "--ac", default="none", help="activation checkpointing: none, full, selective, budget:<MiB>"
    )
    t.add_argument("--swap", action="store_true", help="swap kept activations to host memory")
    t.add_argument("--offload", default="none", choices=OFFLOAD_TARGETS)
    t.add_argument("--mixed-precision", default="fp32", choices=MIXED_PRECISIONS)
    t.add_argument("--fp8", default="none", choices=FP8_RECIPES, help="FP8 linears")
    t.add_argument("--fp8-all-gather", action="store_true", help="FSDP all-gathers in FP8")
    t.add_argument(
        "--grad-reduce-dtype", default="fp32", choices=MIXED_PRECISIONS, help="gradient wire dtype"
    )
    t.add_argument("--compile", action="store_true", help="torch.compile every block")
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="corpus",
        help="corpus (the hp-* packages' text), synthetic, pydoc (CPython's documentation "
        "topics), or a local .txt/.md file, folder, JSON Lines or Parquet path",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer.json or a folder holding one (python -m hp_train.data.tokenizer train "
        "makes one); default: bytes",
    )
    g.add_argument("--text-field", default="text", help="the text column of JSON Lines/Parquet")
    g.add_argument(
        "--eval-fraction", type=float, default=0.0, help="share of documents held out (0: none)"
    )
    g.add_argument("--eval-data", default=None, help="a separate local path to evaluate on")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=4, help="global batches per evaluation")
    g.add_argument(
        "--streaming",
        default="auto",
        choices=("auto", "on", "off"),
        help="read the data as a stream (auto: by its size)",
    )
    r = p.add_argument_group("run")
    r.add_argument("--out", type=Path, default=Path("hp_train_out"))
    r.add_argument("--checkpoint-every", type=int, default=0)
    r.add_argument("--resume", action="store_true", help="from the newest checkpoint that verifies")
    r.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="resume from this checkpoint directory (an error if it does not verify)",
    )
    r.add_argument("--validate", action="store_true")
    r.add_argument("--validate-steps", type=int, default=2)
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--tensorboard", action="store_true", help="TensorBoard events in <out>")
    r.add_argument(
        "--print-plan",
        action="store_true",
        help="print the parallel plan of these flags and exit (one process, no torchrun; "
        "--dp-shard defaults to 1, or to what WORLD_SIZE leaves)",
    )
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options of ``argv`` over those of its ``--config`` file (if any) over the
    defaults.

    Raises:
        ConfigError: the configuration file is missing, not TOML, or has an unknown,
            misplaced or mistyped key.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.set_defaults(**read_config_file(args.config, option_tables(parser, _TABLES)))
        args = parser.parse_args(argv)
    return args


def resolved_options(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """Every option of a run by table, as ``config.toml`` holds them."""
    return resolved_tables(args, option_tables(_parser(), _TABLES))


def _model_config(args: argparse.Namespace, tokenizer_vocab: int | None) -> ModelConfig:
    sizes = {
        field: getattr(args, field)
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
        if getattr(args, field) is not None
    }
    if args.init_from is not None:
        given = [f"--{k.replace('_', '-')}" for k in sizes] + (["--model"] if args.model else [])
        if args.experts is not None:
            given.append("--experts")
        if given:
            raise ConfigError(
                f"--init-from takes the architecture from {args.init_from}/config.json; drop "
                f"{', '.join(given)}"
            )
        from hp_train.checkpoint.hf import read_hf_config

        return read_hf_config(args.init_from, max_seq_len=args.seq_len)
    base = MODEL_PRESETS[args.model or "tiny"]
    if args.n_heads is not None and args.n_kv_heads is None:
        sizes["n_kv_heads"] = args.n_heads
    if tokenizer_vocab is not None and args.vocab_size is None:
        sizes["vocab_size"] = _vocab_for(tokenizer_vocab, args.tp)
    moe = base.moe
    if args.experts is not None:
        moe = MoEConfig(
            n_experts=args.experts,
            top_k=args.top_k,
            expert_ffn_dim=args.expert_ffn_dim or (base.ffn_dim // 2),
            every=args.moe_every,
        )
    seq = max(base.max_seq_len, args.seq_len)
    return ModelConfig(**{**base.__dict__, **sizes, "moe": moe, "max_seq_len": seq})


def _vocab_for(tokens: int, tp: int) -> int:
    """The model vocabulary for a tokenizer of ``tokens`` tokens: rounded up to a multiple of
    64 x tp (the embedding and head split it ``tp`` ways; the padding rows are never a
    target)."""
    unit = 64 * tp
    return -(-tokens // unit) * unit


def parse(
    argv: Sequence[str] | None, world_size: int
) -> tuple[ModelConfig, ParallelConfig, TrainConfig, RunOptions, argparse.Namespace]:
    """The run's configuration from the command line (``world_size`` fills ``dp_shard``)."""
    args = parse_args(argv)
    tokenizer_vocab = None
    if args.tokenizer is not None:
        from hp_train.data.tokenizer import load_tokenizer

        tokenizer_vocab = load_tokenizer(args.tokenizer).vocab_size
    model = _model_config(args, tokenizer_vocab)
    if args.dp_shard is None:
        parallel = ParallelConfig.fill(
            world_size,
            dp_replicate=args.dp_replicate,
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            cp_variant=args.cp_variant,
            ep=args.ep,
            ep_tp=args.ep_tp,
        )
    else:
        parallel = ParallelConfig(
            args.dp_replicate,
            args.dp_shard,
            args.tp,
            args.pp,
            args.cp,
            args.cp_variant,
            args.ep,
            args.ep_tp,
        )
    config = TrainConfig(
        steps=args.steps,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        optimizer=args.optimizer,
        lr=args.lr,
        muon_lr=args.muon_lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        data=args.data,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        eval_fraction=args.eval_fraction,
        eval_data=args.eval_data,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        streaming={"auto": None, "on": True, "off": False}[args.streaming],
        seed=args.seed,
        deterministic=args.deterministic,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        microbatches=args.microbatches if args.microbatches is not None else parallel.pp,
        pp_schedule=args.pp_schedule,
        grad_accum=args.grad_accum,
        clip_grad_norm=args.clip_grad_norm,
        skip_nonfinite=args.skip_nonfinite,
        ac=args.ac,
        swap=args.swap,
        offload=args.offload,
        mixed_precision=args.mixed_precision,
        fp8=args.fp8,
        fp8_all_gather=args.fp8_all_gather,
        grad_reduce_dtype=args.grad_reduce_dtype,
        compile=args.compile,
    )
    options = RunOptions(
        out_dir=args.out,
        resume=args.resume,
        resume_from=args.resume_from,
        validate=args.validate,
        validate_steps=args.validate_steps,
        quiet=args.quiet,
        init_from=args.init_from,
        tensorboard=args.tensorboard,
        options=resolved_options(args),
    )
    return model, parallel, config, options, args


def _print_summary(
    summary: Summary, model: ModelConfig, parallel: ParallelConfig, out: Path
) -> None:
    steps = sorted(summary.losses)
    first, last = summary.losses[steps[0]], summary.losses[steps[-1]]
    peaks = ", ".join("n/a" if p is None else f"{p / 2**20:.0f}" for p in summary.peak_memory_bytes)
    written = [n for n in ("metrics.jsonl", "loss.png") if (out / n).is_file()]
    print(
        f"hp-train: {len(steps)} steps (from step {summary.first_step}) on "
        f"dp_replicate={parallel.dp_replicate} x dp_shard={parallel.dp_shard} x tp={parallel.tp}"
        f"{f' x pp={parallel.pp}' if parallel.pp > 1 else ''}"
        f"{f' x cp={parallel.cp} ({parallel.cp_variant})' if parallel.cp > 1 else ''}"
        f"{_expert_note(parallel)}"
        f" ({'MoE' if model.moe else 'dense'} dim {model.dim}, {model.n_layers} layers)\n"
        f"  loss {first:.4f} -> {last:.4f}; median step {summary.step_time_s * 1e3:.0f} ms, "
        f"{summary.tokens_per_s:.0f} tokens/s; peak memory per rank (MiB): {peaks}\n"
        + _eval_line(summary)
        + _skipped_line(summary)
        + f"  wrote {', '.join(str(out / name) for name in written)}"
        + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else ""),
        flush=True,
    )


def _skipped_line(summary: Summary) -> str:
    if not summary.skipped_steps:
        return ""
    steps = ", ".join(str(s) for s in summary.skipped_steps)
    return (
        f"  skipped {len(summary.skipped_steps)} step(s) with a non-finite loss or gradient "
        f"(--skip-nonfinite): {steps}\n"
    )


def _eval_line(summary: Summary) -> str:
    if not summary.eval_losses:
        return ""
    steps = sorted(summary.eval_losses)
    first, last = summary.eval_losses[steps[0]], summary.eval_losses[steps[-1]]
    return (
        f"  held-out loss {first:.4f} (after step {steps[0] + 1}) -> {last:.4f} (after step "
        f"{steps[-1] + 1}), perplexity {math.exp(min(last, 700.0)):.2f}\n"
    )


def _print_plan(argv: Sequence[str] | None, pre: argparse.Namespace) -> int:
    """``--print-plan``: resolve and print without a process group (rank 0 alone prints
    under torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "0")) or (
        pre.dp_replicate * (pre.dp_shard or 1) * pre.cp * pre.tp * pre.pp
    )
    try:
        model, parallel, config, _, _ = parse(argv, world)
        report = plan_report(model, parallel, config)
    except ConfigError as exc:
        print(f"hp-train: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(report, flush=True)
    return 0


#: Exit codes of :func:`main` besides 0: a configuration error (the message on stderr).
EXIT_CONFIG = 2
#: Training stopped on a non-finite loss, gradient or parameter (``NonFiniteError``).
EXIT_NONFINITE = 3
#: A checkpoint could not be loaded (none verifies, ``--resume-from`` does not) or written.
EXIT_CHECKPOINT = 4


def main(argv: Sequence[str] | None = None) -> int:
    """Run training; returns the process exit code (every rank the same): 0, or
    :data:`EXIT_CONFIG`, :data:`EXIT_NONFINITE`, :data:`EXIT_CHECKPOINT`. The trainer logged
    the last two's message (rank 0's stderr, every rank's log file); a configuration error is
    printed here."""
    try:
        pre = parse_args(argv)
    except ConfigError as exc:
        print(f"hp-train: {exc}", file=sys.stderr)
        return 2
    if pre.print_plan:
        return _print_plan(argv, pre)
    try:
        runtime = init_runtime(pre.device, threads=pre.threads)
    except ValueError as exc:
        print(f"hp-train: {exc}", file=sys.stderr)
        return 2
    try:
        model, parallel, config, options, _ = parse(argv, dist.get_world_size())
        if runtime.rank == 0:
            options.out_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        summary = train(model, parallel, config, options, runtime)
        if runtime.rank == 0 and summary.losses:
            _print_summary(summary, model, parallel, options.out_dir)
    except ConfigError as exc:
        if dist.get_rank() == 0:
            print(f"hp-train: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return EXIT_CONFIG
    except NonFiniteError:
        shutdown()  # every rank raised it at the same step: none is left in a collective
        return EXIT_NONFINITE
    except CheckpointError:
        shutdown()
        return EXIT_CHECKPOINT
    shutdown()
    return 0
