"""``hp-train`` / ``python -m hp_train``: the command line of the training entry point.

Run it under torchrun, e.g. 4 local CPU ranks with FSDP x TP and Muon::

    torchrun --standalone --nproc-per-node 4 -m hp_train --dp-shard 2 --tp 2 --steps 20

``--dp-shard`` defaults to every rank the other dimensions leave. The same command runs on
GPUs (``--device cuda``) or NPUs (``--device npu``) and across hosts with torchrun's usual
flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from hp_train.config import (
    PIPELINE_SCHEDULE_NAMES,
    ConfigError,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from hp_train.presets import model_configs
from hp_train.runtime import init_runtime, shutdown
from hp_train.trainer import RunOptions, Summary, plan_report, train

__all__ = ["MODEL_PRESETS", "main", "parse"]

#: Named model sizes (``--model``; the one table the dry run uses too, ``hp_train.presets``);
#: explicit size flags override a preset's fields.
MODEL_PRESETS: dict[str, ModelConfig] = model_configs()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hp-train", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-dim", "vocab-size"):
        m.add_argument(f"--{name}", type=int, default=None)
    m.add_argument("--experts", type=int, default=None, help="routed experts (makes it MoE)")
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--expert-ffn-dim", type=int, default=None)
    m.add_argument("--moe-every", type=int, default=2)
    d = p.add_argument_group("parallelism (dp_replicate x dp_shard x tp x pp = world size)")
    d.add_argument("--dp-replicate", type=int, default=1)
    d.add_argument("--dp-shard", type=int, default=None, help="default: what is left")
    d.add_argument("--tp", type=int, default=1)
    d.add_argument("--pp", type=int, default=1, help="pipeline stages")
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
    t.add_argument("--data", default="corpus", choices=("corpus", "synthetic"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--deterministic", action="store_true")
    t.add_argument("--log-every", type=int, default=5, help="precision monitoring interval")
    r = p.add_argument_group("run")
    r.add_argument("--out", type=Path, default=Path("hp_train_out"))
    r.add_argument("--checkpoint-every", type=int, default=0)
    r.add_argument("--resume", action="store_true")
    r.add_argument("--validate", action="store_true")
    r.add_argument("--validate-steps", type=int, default=2)
    r.add_argument("--quiet", action="store_true")
    r.add_argument(
        "--print-plan",
        action="store_true",
        help="print the parallel plan of these flags and exit (one process, no torchrun; "
        "--dp-shard defaults to 1, or to what WORLD_SIZE leaves)",
    )
    return p


def parse(
    argv: Sequence[str] | None, world_size: int
) -> tuple[ModelConfig, ParallelConfig, TrainConfig, RunOptions, argparse.Namespace]:
    """The run's configuration from the command line (``world_size`` fills ``dp_shard``)."""
    args = _parser().parse_args(argv)
    base = MODEL_PRESETS[args.model]
    sizes = {
        field: getattr(args, field)
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
        if getattr(args, field) is not None
    }
    if args.n_heads is not None and args.n_kv_heads is None:
        sizes["n_kv_heads"] = args.n_heads
    moe = base.moe
    if args.experts is not None:
        moe = MoEConfig(
            n_experts=args.experts,
            top_k=args.top_k,
            expert_ffn_dim=args.expert_ffn_dim or (base.ffn_dim // 2),
            every=args.moe_every,
        )
    seq = max(base.max_seq_len, args.seq_len)
    model = ModelConfig(**{**base.__dict__, **sizes, "moe": moe, "max_seq_len": seq})
    if args.dp_shard is None:
        parallel = ParallelConfig.fill(
            world_size, dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp
        )
    else:
        parallel = ParallelConfig(args.dp_replicate, args.dp_shard, args.tp, args.pp)
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
        seed=args.seed,
        deterministic=args.deterministic,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        microbatches=args.microbatches if args.microbatches is not None else parallel.pp,
        pp_schedule=args.pp_schedule,
    )
    options = RunOptions(
        out_dir=args.out,
        resume=args.resume,
        validate=args.validate,
        validate_steps=args.validate_steps,
        quiet=args.quiet,
    )
    return model, parallel, config, options, args


def _print_summary(
    summary: Summary, model: ModelConfig, parallel: ParallelConfig, out: Path
) -> None:
    steps = sorted(summary.losses)
    first, last = summary.losses[steps[0]], summary.losses[steps[-1]]
    peaks = ", ".join("n/a" if p is None else f"{p / 2**20:.0f}" for p in summary.peak_memory_bytes)
    print(
        f"hp-train: {len(steps)} steps (from step {summary.first_step}) on "
        f"dp_replicate={parallel.dp_replicate} x dp_shard={parallel.dp_shard} x tp={parallel.tp}"
        f"{f' x pp={parallel.pp}' if parallel.pp > 1 else ''}"
        f" ({'MoE' if model.moe else 'dense'} dim {model.dim}, {model.n_layers} layers)\n"
        f"  loss {first:.4f} -> {last:.4f}; median step {summary.step_time_s * 1e3:.0f} ms, "
        f"{summary.tokens_per_s:.0f} tokens/s; peak memory per rank (MiB): {peaks}\n"
        f"  wrote {out / 'metrics.jsonl'}, {out / 'loss.png'}"
        + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else ""),
        flush=True,
    )


def _print_plan(argv: Sequence[str] | None, pre: argparse.Namespace) -> int:
    """``--print-plan``: resolve and print without a process group (rank 0 alone prints
    under torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "0")) or (
        pre.dp_replicate * (pre.dp_shard or 1) * pre.tp * pre.pp
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run training; returns the process exit code (2 for a configuration error)."""
    pre = _parser().parse_args(argv)
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
        return 2
    shutdown()
    return 0
