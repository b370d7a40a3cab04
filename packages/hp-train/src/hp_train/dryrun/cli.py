"""``hp-dryrun`` / ``python -m hp_train.dryrun``: predict a run, or search for the best layout.

Examples::

    python -m hp_train.dryrun --model moe_505b --topology ascend_supernode \\
        --dp-shard 768 --microbatches 2 --recompute
    python -m hp_train.dryrun --model moe_505b --topology ascend_supernode \\
        --search --memory-limit-gib 64
    python -m hp_train.dryrun --model tiny-moe --dp-shard 2 --tp 2 --rank 1 --print-plan

``--print-plan`` prints the plan the trainer resolves for the rank's model (its pipeline stage)
with each parameter's FSDP flat slot and optimizer group
(:func:`hp_train.dryrun.shapes.planned_model`, ``ParallelPlan.table(rank)``) and exits.

Exit status: 0 on success, 2 on bad input (the message says what was wrong).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from hp_train.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from hp_train.dryrun.memory import GIB
from hp_train.dryrun.planner import dry_run
from hp_train.dryrun.presets import MODEL_PRESETS, Device, device_for, model_preset, topology_preset
from hp_train.dryrun.report import format_dry_run, format_search
from hp_train.dryrun.search import search
from hp_train.dryrun.shapes import planned_model
from hp_train.dryrun.workload import BF16_MIXED, FP32, StepShape

__all__ = ["build_parser", "main"]

_MODEL_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
_MOE_FIELDS = {
    "experts": "n_experts",
    "top_k": "top_k",
    "expert_ffn_dim": "expert_ffn_dim",
    "moe_every": "every",
    "shared_experts": "n_shared_experts",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    ap = argparse.ArgumentParser(
        prog="hp-dryrun",
        description="Predict per-rank memory, communication and step time of a training run "
        "without starting processes, or search for the fastest layout that fits.",
    )
    ap.add_argument("--model", default="tiny", help=f"model preset: {sorted(MODEL_PRESETS)}")
    for name in _MODEL_FIELDS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override {name}")
    for flag in _MOE_FIELDS:
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, help=f"override MoE {flag}")
    ap.add_argument(
        "--topology",
        default=None,
        help="single_host[:N], cluster:HxR or ascend_supernode[:K] (default: one host of the "
        "ranks the degrees give)",
    )
    ap.add_argument("--dp-replicate", type=int, default=1)
    ap.add_argument("--dp-shard", type=int, default=None, help="default: every rank left")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--global-batch", type=int, default=None, help="default: the preset's")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--recompute", action="store_true", help="checkpoint every block")
    ap.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak per rank")
    ap.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak")
    ap.add_argument("--muon-bucket-mb", type=float, default=32.0)
    ap.add_argument("--rank", type=int, default=0, help="the rank per-rank figures are for")
    ap.add_argument("--layers", action="store_true", help="print activations by layer")
    ap.add_argument("--search", action="store_true", help="search every layout of the world")
    ap.add_argument("--memory-limit-gib", type=float, default=64.0)
    ap.add_argument("--top", type=int, default=5, help="configurations the search prints")
    ap.add_argument(
        "--print-plan",
        action="store_true",
        help="print the resolved parallel plan of --rank (shapes, placements, flat slots, "
        "optimizer groups, collectives) and exit",
    )
    return ap


def _model(args: argparse.Namespace) -> tuple[str, ModelConfig, int, int]:
    preset = model_preset(args.model)
    model = preset.model
    changes = {f: getattr(args, f) for f in _MODEL_FIELDS if getattr(args, f) is not None}
    moe_changes = {
        field: getattr(args, flag)
        for flag, field in _MOE_FIELDS.items()
        if getattr(args, flag) is not None
    }
    if moe_changes:
        moe = replace(model.moe, **moe_changes) if model.moe else MoEConfig(**moe_changes)
        changes["moe"] = moe
    name = preset.name + (" (modified)" if changes else "")
    if changes:
        model = replace(model, **changes)
    seq = args.seq_len or preset.seq_len
    if seq > model.max_seq_len:
        model = replace(model, max_seq_len=seq)
    return name, model, seq, args.global_batch or preset.global_batch


def _run(args: argparse.Namespace) -> str:
    name, model, seq, batch = _model(args)
    world = None
    if args.topology is None:
        if args.dp_shard is None:
            raise ConfigError("give --topology or --dp-shard (the world size is unknown)")
        world = args.dp_replicate * args.dp_shard * args.tp * args.pp
        topology = topology_preset(f"single_host:{world}")
    else:
        topology = topology_preset(args.topology)
    device = device_for(topology)
    if args.peak_tflops is not None or args.efficiency is not None:
        device = Device(
            "custom",
            args.peak_tflops * 1e12 if args.peak_tflops is not None else device.peak_flops,
            args.efficiency if args.efficiency is not None else device.efficiency,
        )
    shape = StepShape(
        global_batch=batch,
        seq_len=seq,
        microbatches=args.microbatches,
        recompute=args.recompute,
        optimizer=args.optimizer,
        precision=BF16_MIXED if args.precision == "bf16" else FP32,
        muon_bucket_mb=args.muon_bucket_mb,
    )
    if args.search and not args.print_plan:
        limit = int(args.memory_limit_gib * GIB)
        result = search(model, topology, shape, limit, device=device, model_name=name)
        return format_search(result, args.top)
    if args.dp_shard is None:
        parallel = ParallelConfig.fill(
            topology.world_size, dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp
        )
    else:
        parallel = ParallelConfig(args.dp_replicate, args.dp_shard, args.tp, args.pp)
    if args.print_plan:
        return _plan_text(name, model, parallel, args.rank)
    run = dry_run(model, parallel, topology, shape, device=device, rank=args.rank, model_name=name)
    return format_dry_run(run, layers=args.layers)


def _plan_text(name: str, model: ModelConfig, parallel: ParallelConfig, rank: int) -> str:
    plan = planned_model(model, parallel, rank)
    per_stage = parallel.world_size // parallel.pp
    stage = f", pipeline stage {rank // per_stage}" if parallel.pp > 1 else ""
    return (
        f"hp-dryrun plan: model {name}; dp_replicate={parallel.dp_replicate} x "
        f"dp_shard={parallel.dp_shard} x tp={parallel.tp} x pp={parallel.pp}; rank {rank}"
        f"{stage}\n\n{plan.table(rank)}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on bad input, with a message)."""
    args = build_parser().parse_args(argv)
    try:
        print(_run(args))
    except ConfigError as exc:
        print(f"hp-dryrun: error: {exc}", file=sys.stderr)
        return 2
    return 0
