"""``hp-train`` / ``python -m hp_train``: the command line of the training entry point.

Run it under torchrun, e.g. 4 local CPU ranks with FSDP x TP and Muon::

    torchrun --standalone --nproc-per-node 4 -m hp_train --dp-shard 2 --tp 2 --steps 20

``--dp-shard`` defaults to every rank the other dimensions leave. The same command runs on
GPUs (``--device cuda``) or NPUs (``--device npu``) and across hosts with torchrun's usual
flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hp_dtensor import watchdog
from hp_dtensor.device import DeviceUnavailableError
from hp_dtensor.watchdog import CollectiveError
from hp_train.checkpoint.dcp import CheckpointError
from hp_train.checkpoint.hf import WeightsMismatchError
from hp_train.config.options import (
    TABLE_TITLES,
    CliOption,
    JobArgumentParser,
    add_options,
    config_kwargs,
    field_options,
)
from hp_train.config.presets import model_configs
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.config.toml_file import option_tables, read_config_file, resolved_tables
from hp_train.observe.errors import report_error, write_lines
from hp_train.observe.nonfinite import NonFiniteError
from hp_train.observe.out_dir import (
    OutDirInUseError,
    claim_out_dir,
    prepare_out_dir,
    release_out_dir,
)
from hp_train.observe.profiling import parse_step_ranges, step_list_option
from hp_train.observe.wandb_log import check_wandb_available
from hp_train.parallel.run_plan import plan_report
from hp_train.recovery.signals import StoppedBySignalError
from hp_train.runtime import init_runtime, release_process_groups, shutdown
from hp_train.trainer import RunOptions, Summary, train

__all__ = [
    "EXIT_CHECKPOINT",
    "EXIT_CONFIG",
    "EXIT_NONFINITE",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "MODEL_PRESETS",
    "main",
    "parse",
]

#: Named model sizes (``--model``; the one table the dry run uses too, ``hp_train.config.presets``);
#: explicit size flags override a preset's fields.
MODEL_PRESETS: dict[str, ModelConfig] = model_configs()


#: The dataclasses whose fields are the run's options (:mod:`hp_train.config.options`).
_CONFIGS: tuple[type[Any], ...] = (ModelConfig, MoEConfig, ParallelConfig, TrainConfig)

#: The tables of a ``--config`` file, by the title of the argparse group whose options each
#: holds.
_TABLES = {title: table for table, title in TABLE_TITLES.items()}


def _expert_note(parallel: ParallelConfig) -> str:
    if parallel.ep == 1:
        return ""
    return f" (ep={parallel.ep}{', experts over tp' if parallel.ep_tp else ''})"


def _options() -> tuple[CliOption, ...]:
    return field_options(*_CONFIGS)


def _parser() -> argparse.ArgumentParser:
    """The command line: every field option of :data:`_CONFIGS` in the group of its table,
    and the flags that are no field (:func:`_add_command_flags`)."""
    p = JobArgumentParser(prog="hp-train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML file of options (tables [model], [parallel], [training], [data], [run]; "
        "keys are the options' names with underscores); flags given here override it",
    )
    groups = {table: p.add_argument_group(title) for table, title in TABLE_TITLES.items()}
    groups["model"].add_argument(
        "--model", default=None, choices=sorted(MODEL_PRESETS), help="default: tiny"
    )
    add_options(groups, _options())
    _add_command_flags(groups)
    return p


def _add_command_flags(groups: Mapping[str, argparse._ActionsContainer]) -> None:
    """The options that set no config field: where the run starts from, where it runs and
    writes, and what it does besides training (:class:`~hp_train.trainer.RunOptions`)."""
    groups["model"].add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="a local Hugging Face checkpoint folder (config.json + safetensors; Llama, Qwen2, "
        "Qwen3): the model's architecture and starting weights",
    )
    d = groups["parallel"]
    d.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    d.add_argument("--threads", type=int, default=None, help="CPU threads per rank")
    r = groups["run"]
    r.add_argument("--out", type=Path, default=Path("hp_train_out"))
    r.add_argument(
        "--resume",
        action="store_true",
        help="from the newest checkpoint that verifies (an error if there is none)",
    )
    r.add_argument(
        "--resume-if-present",
        action="store_true",
        help="as --resume, but start a new run when there is no checkpoint at all",
    )
    r.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="resume from this checkpoint directory (an error if it does not verify)",
    )
    r.add_argument(
        "--snapshot-dir",
        type=Path,
        default=None,
        help="this host's folder for --snapshot-every's snapshots (default: "
        "/dev/shm/hp_train/<hash of --out>; memory, outlives the workers, not the host)",
    )
    r.add_argument("--validate", action="store_true")
    r.add_argument("--validate-steps", type=int, default=2)
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--tensorboard", action="store_true", help="TensorBoard events in <out>")
    r.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="one rank's peak TFLOP/s, for MFU (default: estimated from the machine, named in "
        "the log's header; unknown accelerators show MFU n/a)",
    )
    r.add_argument(
        "--wandb",
        action="store_true",
        help="a Weights & Biases run of the same scalars, offline, in <out>/wandb (upload it "
        "later with wandb sync; needs pip install 'hp-train[wandb]')",
    )
    r.add_argument("--wandb-project", default="hp-train", help="the W&B project of --wandb")
    r.add_argument(
        "--profile",
        type=step_list_option,
        default=None,
        metavar="STEPS",
        help="profile these steps (1-based: 5, 5,7 or 5-7): a Chrome/Perfetto trace per rank in "
        "<out>/profile and a table of the top operators in the log",
    )
    r.add_argument(
        "--memory-snapshot",
        type=step_list_option,
        default=None,
        metavar="STEPS",
        help="measure memory in these steps (as --profile): the allocator snapshot on a GPU, "
        "live tensors by kind on CPU, in <out>/memory and the log",
    )
    r.add_argument(
        "--print-plan",
        action="store_true",
        help="print the parallel plan of these flags and exit (one process, no torchrun; "
        "--dp-shard defaults to 1, or to what WORLD_SIZE leaves)",
    )


def _peak_tflops(value: float | None) -> float | None:
    """``--peak-tflops`` (from the command line or a ``--config`` file), checked.

    Raises:
        ConfigError: not a finite number above 0.
    """
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--peak-tflops must be a number of TFLOP/s above 0, got {value!r}")
    return value


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
    _check_extras(args)
    return args


def _check_extras(args: argparse.Namespace) -> None:
    """Refuse, before anything is loaded, an option whose optional package is not installed.

    Raises:
        ConfigError: ``--tensorboard`` without the ``tensorboard`` package.
    """
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        from hp_train.observe.tensorboard import MISSING_TENSORBOARD

        raise ConfigError(
            f"--tensorboard: {MISSING_TENSORBOARD} (not installed), or leave --tensorboard out"
        )


def resolved_options(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """Every option of a run by table, as ``config.toml`` holds them."""
    return resolved_tables(args, option_tables(_parser(), _TABLES))


def _model_config(args: argparse.Namespace, tokenizer_vocab: int | None) -> ModelConfig:
    options = _options()
    sizes = config_kwargs(options, args, ModelConfig)
    if args.init_from is not None:
        given = [o.flag for o in options if o.owner is ModelConfig and o.field in sizes]
        given += ["--model"] if args.model else []
        # The MoE options have defaults, so a value other than its default is one given.
        given += [
            o.flag
            for o in options
            if o.owner is MoEConfig and getattr(args, o.dest) not in (None, o.default)
        ]
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
        experts = config_kwargs(options, args, MoEConfig)
        if not experts.get("expert_ffn_dim"):
            experts["expert_ffn_dim"] = base.ffn_dim // 2
        moe = MoEConfig(**experts)
    seq = max(sizes.pop("max_seq_len", base.max_seq_len), args.seq_len)
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
    from hp_train.data.tokenizer import choice

    # --init-from's own tokenizer unless --tokenizer says otherwise ("bytes": bytes).
    args.tokenizer = choice.resolve_tokenizer(args.tokenizer, args.init_from)
    tokenizer = None
    if args.tokenizer not in (None, choice.BYTES):
        tokenizer = choice.run_tokenizer(args.tokenizer, args.init_from)
    model = _model_config(args, None if tokenizer is None else tokenizer.vocab_size)
    if tokenizer is not None and args.init_from is not None:
        choice.check_init_vocabulary(tokenizer, model.vocab_size, args.init_from)
    options = _options()
    axes = config_kwargs(options, args, ParallelConfig)
    if args.dp_shard is None:
        parallel = ParallelConfig.fill(world_size, **axes)
    else:
        parallel = ParallelConfig(**axes)
        if parallel.world_size != world_size:
            raise ConfigError(
                f"the job has {world_size} ranks but dp_replicate x dp_shard x cp x tp x pp = "
                f"{parallel.world_size}; launch with torchrun --nproc-per-node "
                f"{parallel.world_size}, or leave --dp-shard out to give it every rank left"
            )
    schedule = config_kwargs(options, args, TrainConfig)
    # DualPipeV's warm-up needs two microbatches per pipeline rank.
    fewest = 2 if schedule.get("pp_schedule") == "dualpipev" else 1
    schedule.setdefault("microbatches", fewest * parallel.pp)
    config = TrainConfig(**schedule)
    if args.wandb:
        check_wandb_available()  # before the data loads: a missing extra fails at once
    run = RunOptions(
        out_dir=args.out,
        resume=args.resume,
        resume_from=args.resume_from,
        resume_if_present=args.resume_if_present,
        validate=args.validate,
        validate_steps=args.validate_steps,
        quiet=args.quiet,
        init_from=args.init_from,
        tensorboard=args.tensorboard,
        snapshot_dir=args.snapshot_dir,
        stop_on_signals=True,
        options=resolved_options(args),
        peak_tflops=_peak_tflops(args.peak_tflops),
        profile_steps=() if args.profile is None else parse_step_ranges(args.profile),
        memory_snapshot_steps=(
            () if args.memory_snapshot is None else parse_step_ranges(args.memory_snapshot)
        ),
        wandb=args.wandb,
        wandb_project=args.wandb_project,
    )
    return model, parallel, config, run, args


def _print_summary(
    summary: Summary, model: ModelConfig, parallel: ParallelConfig, out: Path
) -> None:
    steps = sorted(summary.losses)
    first, last = summary.losses[steps[0]], summary.losses[steps[-1]]
    peaks = ", ".join("n/a" if p is None else f"{p / 2**20:.0f}" for p in summary.peak_memory_bytes)
    written = [n for n in ("metrics.jsonl", "loss.png") if (out / n).is_file()]
    print(
        f"hp-train: {len(steps)} steps ({steps[0] + 1}-{steps[-1] + 1}) on "
        f"dp_replicate={parallel.dp_replicate} x dp_shard={parallel.dp_shard} x tp={parallel.tp}"
        f"{f' x pp={parallel.pp}' if parallel.pp > 1 else ''}"
        f"{f' x cp={parallel.cp} ({parallel.cp_variant})' if parallel.cp > 1 else ''}"
        f"{_expert_note(parallel)}"
        f" ({'MoE' if model.moe else 'dense'} dim {model.dim}, {model.n_layers} layers)\n"
        f"  loss {first:.4f} -> {last:.4f}; median step {summary.step_time_s * 1e3:.0f} ms, "
        f"{summary.tokens_per_s:.0f} tokens/s; {summary.memory_label} per rank (MiB): {peaks}\n"
        + _eval_line(summary)
        + _skipped_line(summary)
        + f"  wrote {', '.join(str(out / name) for name in written)}"
        + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else ""),
        flush=True,
    )


def _skipped_line(summary: Summary) -> str:
    if not summary.skipped_steps:
        return ""
    steps = ", ".join(str(s + 1) for s in summary.skipped_steps)  # 1-based, as logged
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
        report_error(str(exc))
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
#: A collective failed: a rank never joined it (``CollectiveTimeoutError``) or left it
#: (``PeerLostError``); each rank prints its own diagnosis (they differ by rank).
EXIT_COLLECTIVE = 5
#: Stopped by SIGTERM (143) or SIGINT (130) after writing a checkpoint of the step every
#: rank finished (``128 + signal``, as a shell reports a process that signal stopped; a process
#: that died of the signal without a checkpoint reports the signal itself).
EXIT_SIGTERM, EXIT_SIGINT = 128 + signal.SIGTERM, 128 + signal.SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    """Run training; returns the process exit code (every rank the same): 0, or
    :data:`EXIT_CONFIG`, :data:`EXIT_NONFINITE`, :data:`EXIT_CHECKPOINT`,
    :data:`EXIT_COLLECTIVE`, :data:`EXIT_SIGTERM`, :data:`EXIT_SIGINT`. The trainer logged
    the non-finite and checkpoint messages (rank 0's stderr, every rank's log file);
    hp_dtensor's watchdog logged a collective failure into the rank's log file, and every rank
    it reached prints it as ``hp-train: ...``; a configuration error is reported here, once
    for the job and before any rank exits (:func:`hp_train.observe.errors.report_error`); rank
    0 prints the stop on a signal with the checkpoint it wrote."""
    try:
        pre = parse_args(argv)
    except ConfigError as exc:
        report_error(str(exc), log=_early_log(argv))
        return 2
    if pre.print_plan:
        return _print_plan(argv, pre)
    try:
        runtime = init_runtime(pre.device, threads=pre.threads)
    except (ValueError, DeviceUnavailableError) as exc:
        report_error(str(exc))
        return 2
    options: RunOptions | None = None
    try:
        model, parallel, config, options, _ = parse(argv, dist.get_world_size())
        prepare_out_dir(Path(options.out_dir), runtime.rank)
        _claim(Path(options.out_dir), runtime.rank)
        summary = train(model, parallel, config, options, runtime)
        if runtime.rank == 0 and summary.losses:
            _print_summary(summary, model, parallel, options.out_dir)
    except (ConfigError, WeightsMismatchError) as exc:
        log = None
        if not isinstance(exc, OutDirInUseError):  # not another run's logs
            # Before the options are resolved (a missing extra, a tokenizer that does not
            # load) the command line's --out is the run's folder all the same.
            out = pre.out if options is None else options.out_dir
            log = (Path(out), runtime.rank)
        report_error(str(exc), log=log)
        release_process_groups()
        return EXIT_CONFIG
    except NonFiniteError:
        shutdown()  # every rank raised it at the same step: none is left in a collective
        return EXIT_NONFINITE
    except CheckpointError:
        shutdown()
        return EXIT_CHECKPOINT
    except StoppedBySignalError as exc:
        if runtime.rank == 0:
            write_lines([f"hp-train: {exc}"])
        shutdown()
        return exc.exit_code
    except CollectiveError as exc:
        write_lines([f"hp-train: {exc}"])
        _abandon_process_group()
        return EXIT_COLLECTIVE
    finally:
        if options is not None and runtime.rank == 0:
            release_out_dir(Path(options.out_dir))
    shutdown()
    return 0


def _early_log(argv: Sequence[str] | None) -> tuple[Path, int] | None:
    """Where an error found while the options are read (a missing extra such as
    ``--tensorboard`` without its package, a bad value) is logged: the rank's log in the
    ``--out`` folder of the command line (or its default), as torchrun's ``RANK`` names the
    rank; None where ``--out`` itself cannot be read (``--print-plan`` writes no log)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--out", type=Path, default=Path("hp_train_out"))
    early.add_argument("--print-plan", action="store_true")
    try:
        known, _ = early.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit:  # argparse's own error (``--out`` without a value): no folder
        return None
    if known.print_plan:
        return None
    return known.out, int(os.environ.get("RANK", "0"))


def _abandon_process_group() -> None:
    """Tear down a process group a failed collective left broken: no barrier (a peer is gone
    or stuck), stop the watchdog's publisher first (it writes to the store)."""
    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def _claim(out_dir: Path, rank: int) -> None:
    """Rank 0 takes the output folder (:func:`hp_train.observe.out_dir.claim_out_dir`); every
    rank raises the same error when another run holds it (collective)."""
    outcome: list[tuple[str, str | None] | None] = [None]
    if rank == 0:
        try:
            outcome = [("warning", claim_out_dir(out_dir))]
        except OutDirInUseError as exc:
            outcome = [("error", str(exc))]
    with watchdog.watch("broadcast_object_list (output folder claim)"):
        dist.broadcast_object_list(outcome, src=0)
    kind, text = outcome[0] or ("warning", None)
    if kind == "error":
        raise OutDirInUseError(text)
    if rank == 0 and text:
        print(f"hp-train: warning: {text}", file=sys.stderr, flush=True)
