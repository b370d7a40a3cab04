"""``hp-dryrun`` / ``python -m hp_train.dryrun``: predict a run, or search for the best layout.

Examples::

    python -m hp_train.dryrun --model moe_505b --topology ascend_supernode \\
        --dp-shard 768 --ep 32 --grad-accum 2 --ac full
    python -m hp_train.dryrun --model moe_505b --topology ascend_supernode --search
    python -m hp_train.dryrun --reproduce-paper
    python -m hp_train.dryrun --model tiny-moe --dp-shard 2 --tp 2 --rank 1 --print-plan

The model, parallel and step flags are the trainer's own options, generated from the same
config fields (:mod:`hp_train.config.options`; model sizes default to the preset's here,
``--mixed-precision`` to bf16); a pair the trainer refuses
(:mod:`hp_train.config.combinations`) is refused with its message. As in the trainer,
``--grad-accum`` splits each step into accumulation steps and ``--microbatches`` is the
pipeline's (with ``--pp``); ``--microbatches`` without ``--pp``, its old spelling of
``--grad-accum``, still works and says it is deprecated. The report is
:func:`hp_train.dryrun.report.format_prediction`'s: units that suit each figure, whether the
peak fits the device, lines wrapped to the terminal (at most 100 columns). ``--search`` keeps
what fits ``--memory-limit-gib`` (default: the device preset's memory); ``--reproduce-paper``
prints :mod:`hp_planner.price.reproduce`'s report for the ``moe_505b`` preset. The pricing is
:mod:`hp_planner.price`'s, of the trainer's model (:class:`~hp_train.dryrun.trainer_model
.TrainerModel`).

``--print-plan`` prints the plan the trainer resolves for the rank's model (its pipeline stage)
with each parameter's FSDP flat slot and optimizer group
(:func:`hp_planner.price.planned_model`, ``ParallelPlan.table(rank)``) and exits.

Exit status: 0 on success, 2 on bad input (the message says what was wrong).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from hp_layout import Topology
from hp_planner import PlanInputError
from hp_planner.price import (
    GIB,
    Device,
    Precision,
    SearchSpace,
    StepShape,
    device_for,
    dry_run,
    format_reproduction,
    format_search,
    planned_model,
    precision_of,
    rank_stage,
    reproduce_paper,
    search,
    topology_preset,
)
from hp_train.config.options import (
    TABLE_TITLES,
    CliOption,
    JobArgumentParser,
    add_options,
    config_kwargs,
    field_options,
)
from hp_train.config.presets import MODEL_PRESETS, model_preset
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.dryrun.report import format_prediction, report_width, wrap_lines
from hp_train.dryrun.trainer_model import TrainerModel

__all__ = ["build_parser", "main"]

#: The trainer's options the dry run takes besides every model, MoE and parallel option.
_TRAIN_FIELDS = (
    "global_batch",
    "seq_len",
    "microbatches",
    "grad_accum",
    "pp_schedule",
    "ac",
    "swap",
    "offload",
    "optimizer",
    "mixed_precision",
    "grad_reduce_dtype",
    "fp8",
    "fp8_all_gather",
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None


def _shared_options() -> tuple[CliOption, ...]:
    """The trainer's options (:mod:`hp_train.config.options`) as the dry run takes them: model
    sizes default to the preset's, and a few mean or default to something else here."""
    preset = "the preset's"
    changed: dict[str, dict[str, Any]] = {
        "global_batch": {"default": None, "unset": preset},
        "seq_len": {"default": None, "unset": preset},
        "microbatches": {
            "default": 1,
            "unset": None,
            "help": "pipeline microbatches per step with --pp > 1 (without --pp: deprecated, "
            "the old spelling of --grad-accum)",
        },
        "swap": {
            "help": "the blocks' kept activations in host memory (with --ac none or selective); "
            "with --search, each swappable policy is tried with and without it"
        },
        "mixed_precision": {"default": "bf16", "aliases": ("--precision",)},
    }
    shared = []
    for opt in field_options(ModelConfig, MoEConfig, ParallelConfig, TrainConfig):
        if opt.owner in (ModelConfig, MoEConfig):
            shared.append(replace(opt, default=None, unset=preset))
        elif opt.owner is ParallelConfig:
            shared.append(opt)
        elif opt.field in _TRAIN_FIELDS:
            shared.append(replace(opt, **changed.get(opt.field, {})))
    return tuple(shared)


def build_parser() -> argparse.ArgumentParser:
    """The command line's argument parser: the trainer's model, parallel and step options
    (:func:`_shared_options`) and the dry run's own."""
    ap = JobArgumentParser(
        prog="hp-dryrun",
        description="Predict per-rank memory, communication and step time of a training run "
        "without starting processes, or search for the fastest layout that fits.",
    )
    options = _shared_options()
    groups = {
        t: ap.add_argument_group(TABLE_TITLES[t]) for t in dict.fromkeys(o.table for o in options)
    }
    groups["model"].add_argument(
        "--model", default="tiny", help=f"model preset: {sorted(MODEL_PRESETS)}"
    )
    add_options(groups, options)
    _add_prediction_flags(ap)
    _add_search_flags(ap)
    return ap


def _add_prediction_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--topology",
        default=None,
        help="single_host[:N], cluster:HxR or ascend_supernode[:K] (default: one host of the "
        "ranks the degrees give)",
    )
    ap.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="rows an expert-parallel rank receives over rows it sends (1: balanced router)",
    )
    ap.add_argument(
        "--recompute", action="store_true", help="the same as --ac full (older spelling)"
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak per rank")
    ap.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak")
    ap.add_argument("--muon-bucket-mb", type=float, default=32.0)
    ap.add_argument("--rank", type=int, default=0, help="the rank per-rank figures are for")
    ap.add_argument("--layers", action="store_true", help="print activations by layer")
    ap.add_argument(
        "--reproduce-paper",
        action="store_true",
        help="the 505B MoE on the 768-die supernode: the best configurations found beside the "
        "paper's figures, and the same model under modeled PyTorch FSDP2 and Megatron DDP",
    )
    ap.add_argument(
        "--print-plan",
        action="store_true",
        help="print the resolved parallel plan of --rank (shapes, placements, flat slots, "
        "optimizer groups, collectives) and exit",
    )


def _add_search_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--search", action="store_true", help="search every layout of the world")
    ap.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="the search's per-rank limit (default: the device preset's memory)",
    )
    ap.add_argument("--top", type=int, default=5, help="configurations the search prints")
    for axis in ("dp-replicate", "tp", "ep", "cp", "pp"):
        ap.add_argument(
            f"--search-{axis}",
            type=_ints,
            default=None,
            metavar="N,N,...",
            help=f"{axis} degrees the search tries (default: every divisor; the whole space at "
            "hundreds of ranks takes minutes)",
        )
    ap.add_argument("--search-microbatches", type=_ints, default=(1, 2, 4, 8, 16))
    ap.add_argument(
        "--search-ac",
        type=lambda text: tuple(text.split(",")),
        default=("none", "selective", "full"),
        metavar="AC,AC,...",
        help="checkpointing policies the search tries",
    )


def _model(args: argparse.Namespace) -> tuple[str, ModelConfig, int, int]:
    preset = model_preset(args.model)
    model = preset.model
    options = _shared_options()
    changes = config_kwargs(options, args, ModelConfig)
    moe_changes = config_kwargs(options, args, MoEConfig)
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


def _precision(args: argparse.Namespace) -> Precision:
    return precision_of(args.mixed_precision, args.grad_reduce_dtype)


def _device(args: argparse.Namespace, topology: Topology) -> Device:
    """The topology's device, with ``--peak-tflops`` and ``--efficiency`` where given."""
    device = device_for(topology)
    if args.peak_tflops is None and args.efficiency is None:
        return device
    return replace(
        device,
        name="custom",
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops is not None else device.peak_flops,
        efficiency=args.efficiency if args.efficiency is not None else device.efficiency,
    )


def _step_shape(args: argparse.Namespace, batch: int, seq: int) -> StepShape:
    """The step the options describe (``--swap`` is searched over under ``--search``)."""
    return StepShape(
        global_batch=batch,
        seq_len=seq,
        microbatches=_microbatches(args),
        pipeline_steps=args.grad_accum if args.pp > 1 else 1,
        ac="full" if args.recompute else args.ac,
        optimizer=args.optimizer,
        precision=_precision(args),
        muon_bucket_mb=args.muon_bucket_mb,
        offload=args.offload,
        fp8=args.fp8,
        fp8_all_gather=args.fp8_all_gather,
        expert_imbalance=args.expert_imbalance,
        pp_schedule=args.pp_schedule,
        swap=args.swap and not args.search,
    )


def _microbatches(args: argparse.Namespace) -> int:
    """The step's microbatches: the pipeline's ``--microbatches`` with ``--pp > 1`` (each of
    the ``--grad-accum`` pipeline steps runs that many: ``StepShape.pipeline_steps``), the
    accumulation steps of ``--grad-accum`` without. ``--microbatches N>1`` without ``--pp`` is
    the old spelling of ``--grad-accum``: taken, with a deprecation note on stderr.

    Raises:
        ConfigError: both spellings without ``--pp`` with different values.
    """
    if args.pp > 1:
        return int(args.microbatches)
    if args.microbatches == 1:
        return int(args.grad_accum)
    if args.grad_accum not in (1, args.microbatches):
        raise ConfigError(
            f"--microbatches {args.microbatches} and --grad-accum {args.grad_accum}: without "
            "--pp, --microbatches is the old spelling of --grad-accum; give --grad-accum alone"
        )
    print(
        f"hp-dryrun: warning: --microbatches {args.microbatches} without --pp is deprecated: "
        f"it is the trainer's --grad-accum; use --grad-accum {args.microbatches}",
        file=sys.stderr,
    )
    return int(args.microbatches)


def _run(args: argparse.Namespace) -> str:
    if args.reproduce_paper:
        paper = model_preset("moe_505b")
        step = StepShape(paper.global_batch, paper.seq_len)
        return format_reproduction(
            reproduce_paper(TrainerModel(paper.model), step, model_name=paper.name)
        )
    name, model, seq, batch = _model(args)
    if args.topology is None:
        if args.dp_shard is None:
            raise ConfigError("give --topology or --dp-shard (the world size is unknown)")
        world = args.dp_replicate * args.dp_shard * args.cp * args.tp * args.pp
        topology = topology_preset(f"single_host:{world}")
    else:
        topology = topology_preset(args.topology)
    device = _device(args, topology)
    shape = _step_shape(args, batch, seq)
    if args.search and not args.print_plan:
        gib = args.memory_limit_gib
        limit = device.memory_bytes if gib is None else int(gib * GIB)
        space = SearchSpace(
            dp_replicate=args.search_dp_replicate,
            tp=args.search_tp,
            ep=args.search_ep,
            cp=args.search_cp,
            pp=args.search_pp,
            microbatches=args.search_microbatches,
            ac=args.search_ac,
            swap=(False, True) if args.swap else (False,),
        )
        result = search(
            TrainerModel(model), topology, shape, limit, device=device, space=space, model_name=name
        )
        text = format_search(result, args.top)
        return "\n".join(wrap_lines(text.splitlines(), report_width()))
    axes = {
        "cp": args.cp,
        "cp_variant": args.cp_variant,
        "ep": args.ep,
        "ep_tp": args.ep_tp,
    }
    if args.dp_shard is None:
        parallel = ParallelConfig.fill(
            topology.world_size, dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp, **axes
        )
    else:
        parallel = ParallelConfig(args.dp_replicate, args.dp_shard, args.tp, args.pp, **axes)
    if args.print_plan:
        return _plan_text(name, model, parallel, args.rank)
    run = dry_run(
        TrainerModel(model),
        parallel,
        topology,
        shape,
        device=device,
        rank=args.rank,
        model_name=name,
    )
    return format_prediction(run, layers=args.layers, width=report_width())


def _plan_text(name: str, model: ModelConfig, parallel: ParallelConfig, rank: int) -> str:
    """The rank's stage: its parallel plan with the rank's flat slots, then each MoE module's
    expert-parallel plan on the rank and the context-parallel cores."""
    priced = TrainerModel(model)
    plan = planned_model(priced, parallel, rank)
    stage = rank_stage(priced, parallel, rank)
    parts = [
        f"hp-dryrun plan: model {name}; dp_replicate={parallel.dp_replicate} x "
        f"dp_shard={parallel.dp_shard} x cp={parallel.cp} x tp={parallel.tp} x "
        f"pp={parallel.pp}; ep={parallel.ep}; rank {rank}"
        + (f", pipeline stage {stage.index}" if parallel.pp > 1 else ""),
        plan.table(rank),
    ]
    parts += [
        f"expert parallel: {expert.module}\n{expert.plan.table(rank)}" for expert in stage.experts
    ]
    if stage.context is not None:
        parts.append(
            f"context parallel ({stage.context.variant}) over cp={parallel.cp}: "
            + ", ".join(stage.context.modules)
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on bad input, with a message)."""
    args = build_parser().parse_args(argv)
    try:
        print(_run(args))
    except (ConfigError, PlanInputError) as exc:
        print(f"hp-dryrun: error: {exc}", file=sys.stderr)
        return 2
    return 0
