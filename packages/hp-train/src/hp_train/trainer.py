"""The training loop, as a :class:`Trainer` that reads top to bottom: build, (validate,)
resume, then for every step train, monitor, evaluate, log and checkpoint; then report.

Every rank runs it with the same arguments (:func:`train` is the one-call form). Rank 0 draws
the progress bar and writes ``plan.json`` (:mod:`hp_train.parallel.run_plan`), ``config.toml`` and
``hp_train_config.json`` (the run's configuration: :mod:`hp_train.config.toml_file`,
:mod:`hp_train.observe.run_record`), ``metrics.jsonl``, ``loss.png`` (with matplotlib) and
TensorBoard
events (``--tensorboard``) into the output folder; every rank logs to
``<out>/logs/rank_<r>.log``; checkpoints go to ``<out>/checkpoints``, each with the data
loader's position (``data_state.json``) and the run's configuration, so a resumed run sees
the batches an uninterrupted one would and refuses a configuration it cannot continue.

Faults: every step checks, before the optimizer step, that the global loss and gradients are
finite (:mod:`hp_train.observe.nonfinite`); a non-finite one stops the run with
:class:`~hp_train.observe.nonfinite.NonFiniteError` naming the first non-finite parameter or
gradient
(or, with ``skip_nonfinite``, skips the step), and no checkpoint is written from non-finite
state. ``--resume`` loads the newest checkpoint that verifies against its manifest
(:func:`hp_train.checkpoint.dcp.verify_checkpoint`) and loads, saying which it skipped and
why; with nothing to resume from it is a configuration error unless ``--resume-if-present``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch
from hp_fsdp import FSDPModule
from hp_offload import OffloadedOptimizer
from hp_train import __version__
from hp_train.checkpoint.dcp import (
    LEGACY_MARK,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointListing,
    CheckpointLoadError,
    StageOf,
    Verification,
    checkpoints_newest_first,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from hp_train.checkpoint.hf.carry import checkpoint_files
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.config.toml_file import CONFIG_FILE, dump_toml
from hp_train.data.loader import Batch, DataSpec, TrainData, build_data
from hp_train.data.tokenizer import TextTokenizer
from hp_train.data.tokenizer.choice import run_tokenizer as choose_tokenizer
from hp_train.model.llama import Transformer, lm_loss
from hp_train.objects import gather_objects
from hp_train.observe.flops import mfu, training_flops_per_token
from hp_train.observe.layer_norms import global_layer_norms
from hp_train.observe.logs import (
    CONSOLE,
    FILE_ONLY,
    close_logging,
    console_is_terminal,
    setup_logging,
)
from hp_train.observe.metrics import (
    MEMORY_LABELS,
    MetricsWriter,
    memory_key,
    peak_memory_bytes,
    per_rank_memory,
    read_metrics,
    write_json,
)
from hp_train.observe.monitor import (
    LayerNorms,
    clip_grads_to_norm_,
    gather_probes,
    global_grad_norm,
    probe_batch,
    probe_divergences,
    snapshot,
)
from hp_train.observe.nonfinite import (
    NonFiniteError,
    count_nonfinite,
    first_nonfinite,
    nonfinite_state,
)
from hp_train.observe.peak_flops import Peak, peak_flops
from hp_train.observe.plot import write_curves
from hp_train.observe.progress import ProgressBar
from hp_train.observe.run_header import (
    RunFacts,
    command_line,
    config_hash,
    end_line,
    header_lines,
    stop_line,
)
from hp_train.observe.run_record import RECORD_FILE, read_record, resume_conflicts, run_record
from hp_train.observe.step_line import StepFigures, format_number, step_line
from hp_train.observe.step_observers import StepObservers, open_step_observers
from hp_train.observe.tensorboard import (
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    GRAD_NORM,
    MEMORY_TAGS,
    MFU,
    MOE_AUX_LOSS,
    STEP_TIME_S,
    TOKENS_PER_S,
    TRAIN_LOSS,
    TensorBoardLog,
    lr_tag,
    open_tensorboard,
    peak_mib,
)
from hp_train.optim import build_optimizer, build_schedule
from hp_train.parallel.context import shard_batch
from hp_train.parallel.expert import scale_aux_gradient
from hp_train.parallel.job import plan_run
from hp_train.parallel.parallelize import (
    build_layout,
    check_model_fits,
    parallelize,
)
from hp_train.parallel.pipeline import PipelineRunner, build_pipeline, stage_boundaries
from hp_train.parallel.rng import seed_dropout
from hp_train.parallel.run_plan import PLAN_FILE, check_applied, write_plan
from hp_train.parallel.virtual import StagedTransformer, keep_stages
from hp_train.recovery.keeper import SnapshotKeeper
from hp_train.recovery.recover import recover_from_snapshots
from hp_train.recovery.setup import host_name, run_id, snapshot_root
from hp_train.recovery.signals import StoppedBySignalError, StopSignals
from hp_train.recovery.snapshot_file import SnapshotHeader, remove_other_runs
from hp_train.recovery.state import TrainingState
from hp_train.runtime import Runtime

__all__ = [
    "DATA_STATE_FILE",
    "SKIPPED_FILE",
    "RunOptions",
    "Summary",
    "Trainer",
    "check_vocabulary",
    "data_spec",
    "run_tokenizer",
    "train",
]

#: The data loader's position, in every checkpoint.
DATA_STATE_FILE = "data_state.json"
#: The steps skipped for non-finite values so far (``skip_nonfinite``), in every checkpoint.
SKIPPED_FILE = "skipped_steps.json"
#: After a stop signal, the ranks agree within two steps (the one in flight, then the next
#: one's loss all-reduce): a rank that has not after this many of its longest steps is stuck.
_GRACE_STEPS = 3
#: Fields of the run record a resume may change besides ``run_record.RESUMABLE_FIELDS``: how
#: many non-finite steps to tolerate (resuming a run that stopped on one with
#: ``--skip-nonfinite N`` is what the option is for; checkpoints written before it existed
#: do not record it).
_ALSO_RESUMABLE = ("training.skip_nonfinite",)


@dataclass(frozen=True)
class RunOptions:
    """Where a run writes and what it does besides training.

    Attributes:
        out_dir: metrics, plot, logs and checkpoints.
        resume: continue from the newest checkpoint in ``out_dir/checkpoints`` that verifies
            against its manifest and loads (skipping, with a warning naming the file or the
            error, any that do not); a configuration error when there is none at all.
        resume_if_present: ``resume``, but start a new run when there is no checkpoint at all
            (for a command that both starts a job and restarts it).
        resume_from: continue from this checkpoint directory (verified; an error if it does
            not verify or does not exist); implies ``resume``.
        validate: before training, run the tensor-parallel plan in validation mode against a
            single-device run for ``validate_steps`` steps (raises on the first mismatch).
        validate_steps: steps of that check.
        quiet: no progress bar; only warnings on the console.
        init_from: a local Hugging Face checkpoint folder whose weights the model starts from
            (its architecture is the run's ``ModelConfig``:
            :func:`hp_train.checkpoint.hf.read_hf_config`).
            A resumed run takes the checkpoint's weights instead.
        tensorboard: write TensorBoard event files into ``out_dir/tensorboard``.
        profile_steps: 1-based steps to profile (:class:`hp_train.observe.profiling.StepProfiler`:
            a trace per rank in ``out_dir/profile``, a top-operators table in the log).
        memory_snapshot_steps: 1-based steps whose memory to measure
            (:class:`hp_train.observe.memory_snapshot.MemorySnapshot`, into ``out_dir/memory``).
        wandb: an offline Weights & Biases run of the scalars in ``out_dir/wandb`` (rank 0;
            :func:`hp_train.observe.wandb_log.open_wandb`).
        wandb_project: its W&B project.
        snapshot_dir: this host's folder for in-memory snapshots (``snapshot_every``); None:
            :func:`hp_train.recovery.setup.snapshot_root`'s default under ``/dev/shm``.
        stop_on_signals: on SIGTERM or SIGINT, finish the step the ranks agree on, write a
            checkpoint and raise :class:`hp_train.recovery.signals.StoppedBySignalError` (the
            command line's behaviour; from the main thread only).
        options: the resolved command-line options by table, written as ``config.toml`` (the
            command line fills them; None from Python: no ``config.toml``).
        peak_tflops: one rank's peak TFLOP/s for MFU; None: estimated from the machine
            (:func:`hp_train.observe.peak_flops.peak_flops`), or unknown.
        command: the command line the log header names; None: this process's ``sys.argv``.
    """

    out_dir: Path
    resume: bool = False
    resume_from: Path | None = None
    resume_if_present: bool = False
    validate: bool = False
    validate_steps: int = 2
    quiet: bool = False
    init_from: Path | None = None
    tensorboard: bool = False
    snapshot_dir: Path | None = None
    stop_on_signals: bool = False
    options: Mapping[str, Mapping[str, object]] | None = None
    profile_steps: tuple[int, ...] = ()
    memory_snapshot_steps: tuple[int, ...] = ()
    wandb: bool = False
    wandb_project: str = "hp-train"
    peak_tflops: float | None = None
    command: str | None = None


@dataclass(frozen=True)
class Summary:
    """What a run did (identical on every rank).

    Attributes:
        losses: global loss of every step run by this invocation, by step.
        first_step: the step this invocation started at (> 0 after a resume).
        tokens_per_s: median tokens per second over the steps (all ranks together).
        step_time_s: median step time.
        peak_memory_bytes: per rank (see :func:`hp_train.observe.metrics.peak_memory_bytes`).
        checkpoint: the last checkpoint written, if any.
        eval_losses: the held-out loss of every evaluation of this invocation, by the step
            after which it ran (``eval_every``).
        mfu: model FLOPs utilization at the median step time (None without a known peak).
        memory_label: what ``peak_memory_bytes`` measures (``peak RSS`` on CPU, ``peak
            allocated`` on an accelerator).
        skipped_steps: the steps skipped for a non-finite loss or gradient
            (``skip_nonfinite``) over the whole run, a resumed one's earlier ones included.
    """

    losses: dict[int, float]
    first_step: int
    tokens_per_s: float
    step_time_s: float
    peak_memory_bytes: list[int | None]
    checkpoint: str | None
    eval_losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    mfu: float | None = None
    memory_label: str = "peak memory"


@dataclass
class _Loop:
    """The state of one invocation's step loop: its writers and what it measured (steps
    0-based, as :class:`Summary` keeps them)."""

    metrics: MetricsWriter | None
    board: TensorBoardLog | None
    bar: ProgressBar
    tty: bool
    first: int
    observers: StepObservers
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    last_checkpoint: str | None = None
    snapshot_ms: float | None = None

    def close(self) -> None:
        """Close the bar, the writers and the observers."""
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()
        self.observers.close()


def _set_determinism(config: TrainConfig) -> None:
    torch.manual_seed(config.seed)
    if config.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _write_pid(out_dir: Path, rank: int) -> None:
    """``<out>/pids/rank_<r>.pid``: which process is which rank (for operators and tests)."""
    pids = out_dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank_{rank}.pid").write_text(f"{os.getpid()}\n")


def data_spec(config: TrainConfig) -> DataSpec:
    """The data a run of ``config`` reads."""
    return DataSpec(
        source=config.data,
        text_field=config.text_field,
        eval_fraction=config.eval_fraction,
        eval_data=config.eval_data,
        streaming=config.streaming,
    )


def run_tokenizer(config: TrainConfig, init_from: Path | None = None) -> TextTokenizer:
    """The run's tokenizer: ``config.tokenizer``'s, or bytes (None or ``"bytes"``); named
    "<folder> (from --init-from)" when it is the ``init_from`` folder's."""
    return choose_tokenizer(config.tokenizer, init_from)


def check_vocabulary(model_config: ModelConfig, tokenizer: TextTokenizer) -> None:
    """Raise :class:`ConfigError` when ``tokenizer`` has ids the model cannot embed."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens and the "
            f"model's vocabulary only {model_config.vocab_size}: use --vocab-size "
            f">= {tokenizer.vocab_size} (or leave it out to take the tokenizer's)"
        )


class Trainer:
    """One training run (collective: every rank builds one with the same arguments and calls
    :meth:`run`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        parallel: ParallelConfig,
        config: TrainConfig,
        options: RunOptions,
        runtime: Runtime,
    ) -> None:
        # Logging first, so that the run's log says what it ran and why it stopped, whatever
        # stops it (a configuration error below included).
        self.log = setup_logging(options.out_dir, runtime.rank, quiet=options.quiet)
        self.current_step: int | None = None  # 0-based, while a step runs
        try:
            self.flops_per_token = training_flops_per_token(model_config, config.seq_len)
            self.peak: Peak = peak_flops(
                runtime.device, config.mixed_precision, options.peak_tflops
            )
            self._log_header(model_config, parallel, config, options, runtime)
            self._check_and_keep(model_config, parallel, config, options, runtime)
        except BaseException as exc:
            self._log_stop(exc)
            close_logging()
            raise

    def _log_header(
        self,
        model_config: ModelConfig,
        parallel: ParallelConfig,
        config: TrainConfig,
        options: RunOptions,
        runtime: Runtime,
    ) -> None:
        """The run's header block into this rank's log file
        (:mod:`hp_train.observe.run_header`)."""
        device = str(runtime.device)
        if runtime.device.type == "cuda" and torch.cuda.is_available():
            device += f" ({torch.cuda.get_device_name(runtime.device)})"
        mesh = {
            name: getattr(parallel, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
        }
        if parallel.ep > 1:
            mesh["ep (within dp_shard)"] = parallel.ep
        facts = RunFacts(
            version=__version__,
            command=options.command or command_line(sys.argv),
            config_hash=config_hash(run_record(model_config, parallel, config)),
            world_size=runtime.world_size,
            rank=runtime.rank,
            mesh=mesh,
            device=device,
            flops_per_token=self.flops_per_token,
            seq_len=config.seq_len,
            peak_flops=self.peak.flops,
            peak_how=self.peak.how,
        )
        for line in header_lines(facts):
            self.log.info("%s", line, extra=FILE_ONLY)

    def _log_stop(self, exc: BaseException) -> None:
        """The run's last line, for an error or a signal that stopped it (the log file only:
        the console shows the error its own way); a traceback where the error is not one of
        the run's own reports."""
        step = None if self.current_step is None else self.current_step + 1
        reported = (
            ConfigError,
            NonFiniteError,
            CheckpointError,
            StoppedBySignalError,
            KeyboardInterrupt,
        )
        trace = None if isinstance(exc, reported) else exc
        self.log.error("%s", stop_line(exc, step), exc_info=trace, extra=FILE_ONLY)

    def _check_and_keep(
        self,
        model_config: ModelConfig,
        parallel: ParallelConfig,
        config: TrainConfig,
        options: RunOptions,
        runtime: Runtime,
    ) -> None:
        """The checks of the run's configuration that need no process group (each raises
        :class:`ConfigError` naming what is wrong), then the run's fixed state."""
        check_model_fits(model_config, parallel)
        self.local_batch = config.check_batch(parallel)
        if config.seq_len > model_config.max_seq_len:
            raise ConfigError(
                f"seq_len={config.seq_len} exceeds the model's max_seq_len="
                f"{model_config.max_seq_len}"
            )
        check_combination(model_config, parallel, config)
        self.tokenizer = run_tokenizer(config, options.init_from)
        check_vocabulary(model_config, self.tokenizer)
        self.model_config = model_config
        self.parallel = parallel
        self.config = config
        self.options = options
        self.runtime = runtime
        self.is_main = runtime.rank == 0
        self.out = options.out_dir
        self.checkpoints = self.out / "checkpoints"
        self.tokens_per_step = config.global_batch * config.seq_len
        self.skipped: list[int] = []
        self.keeper: SnapshotKeeper | None = None
        self.signals: StopSignals | None = None
        self.stop_signal: int | None = None
        self.memory_key = memory_key(runtime.device)

    # ----------------------------------------------------------------------------- build
    def build(self) -> None:
        """Data, model (laid out, with its pipeline stage), optimizer; writes the plan and the
        configuration."""
        _set_determinism(self.config)
        self.job = plan_run(self.model_config, self.parallel, self.config)
        self.layout = build_layout(self.parallel, self.runtime.device.type)
        self.data = self._build_data()
        if self.options.validate:
            self._validate()
        _write_pid(self.out, self.runtime.rank)
        self.model = self._build_model()
        # Dropout's random streams: one per data shard, shared by tensor-parallel peers.
        seed_dropout(self.config, self.layout, self.runtime.rank)
        self.pipeline = self._build_pipeline()
        muon_plan = self.job.stage_of(self.runtime.rank).muon_plan(self.runtime.rank)
        self.optimizer = build_optimizer(self.model, self.config, muon_plan=muon_plan)
        self.group_names = group_names(self.optimizer)
        check_applied(self.job, self.model, self.optimizer, self.layout, self.runtime.rank)
        write_plan(self.out / PLAN_FILE, self.job, self.runtime.rank)
        self.stage_of = (
            None
            if self.pipeline is None
            else StageOf(self.pipeline.stage, self.pipeline.num_stages)
        )
        self.record = run_record(self.model_config, self.parallel, self.config)
        if self.is_main:
            write_json(self.out / RECORD_FILE, self.record)
            if self.options.options is not None:
                (self.out / CONFIG_FILE).write_text(dump_toml(self.options.options))

    def _build_data(self) -> TrainData:
        data = build_data(
            data_spec(self.config),
            self.tokenizer,
            seq_len=self.config.seq_len,
            seed=self.config.seed,
        )
        self.log.info("data: %s", data.describe())
        return data

    def _validate(self) -> None:
        from hp_train.validation import validate_tp_plan

        whole = [
            self.data.batch(step, self.config.global_batch, 0, 1)
            for step in range(self.options.validate_steps)
        ]
        message = validate_tp_plan(
            self.model_config, self.layout, whole, self.config, self.runtime.device
        )
        self.log.info("%s", message)

    def _build_model(self) -> Transformer:
        torch.manual_seed(self.config.seed)
        # Several stages per pipeline rank run through views of one StagedTransformer.
        staged = self.job.schedule is not None and self.config.virtual_stages > 1
        with self.runtime.device:
            model = (StagedTransformer if staged else Transformer)(
                self.model_config, dropout=self.config.dropout
            )
        if self.layout.pipeline_mesh is not None and self.job.schedule is not None:
            # Every rank initializes the whole model (the same numbers as one device), then
            # keeps its stages (the JobPlan's schedule places them).
            rank = self.layout.pipeline_mesh.mesh.coordinate(self.runtime.rank)[0]
            plan = self.job.schedule
            boundaries = stage_boundaries(self.model_config, plan.num_stages)
            keep_stages(model, plan.stages_of(rank), boundaries)
            # The schedule scales each microbatch's loss by 1 / microbatches; the MoE layers'
            # load-balancing losses enter the gradients alike.
            scale_aux_gradient(model, 1.0 / self.config.microbatches)
        planned = self.job.stage_of(self.runtime.rank)
        parallelize(model, self.layout, config=self.config, plan=planned)
        if self.options.init_from is not None and not self._will_resume():
            from hp_train.checkpoint.hf import load_hf_weights

            load_hf_weights(model, self.options.init_from)
            self.log.info("initialized from %s", self.options.init_from)
        return model

    def _build_pipeline(self) -> PipelineRunner | None:
        if self.layout.pipeline_mesh is None:
            return None
        return build_pipeline(
            self.model,
            self.layout.pipeline_mesh,
            schedule=self.config.pp_schedule,
            microbatches=self.config.microbatches,
            device=self.runtime.device,
            virtual_stages=self.config.virtual_stages,
        )

    # ---------------------------------------------------------------------------- resume
    def _will_resume(self) -> bool:
        if self.options.resume_from is not None:
            return True
        wanted = self.options.resume or self.options.resume_if_present
        return wanted and bool(checkpoints_newest_first(self.checkpoints))

    def resume(self) -> int:
        """With ``resume`` (or ``resume_if_present``): load the newest checkpoint that
        verifies and loads (weights, optimizer, data position, skipped steps) and return its
        step; with ``resume_from`` that one; else 0 (collective).

        Raises:
            ConfigError: the checkpoint's run differs from this one in a field a resume cannot
                change (the message names each); ``resume_from`` does not exist or is a folder
                of checkpoints; ``resume`` without ``resume_if_present`` and no checkpoint to
                resume from (the message names the folder and any unfinished save in it).
            CheckpointCorruptError: ``resume_from`` does not verify or load, or checkpoints
                exist and none verifies and loads (the message names each and its problem).
        """
        resuming = self.options.resume or self.options.resume_if_present
        self.keeper = self._snapshot_keeper(new_run=not resuming and not self.options.resume_from)
        if self.options.resume_from is not None:
            chosen = self._chosen_checkpoint(Path(self.options.resume_from))
            return self._from_disk(lambda: self._load(chosen))
        if not resuming:
            return 0
        if self.keeper is not None:
            recovered = self._recover(self.keeper)
            if recovered is not None:
                return recovered
        return self._from_disk(self._resume_newest)

    def _from_disk(self, load: Callable[[], int]) -> int:
        """``load()``'s step, its time logged as the recovery's."""
        began = time.perf_counter()
        step = load()
        if step:
            self.log.info(
                "recovery: step %d from disk in %.2f s", step, time.perf_counter() - began
            )
        return step

    # ------------------------------------------------------------------------- snapshots
    def _snapshot_keeper(self, new_run: bool) -> SnapshotKeeper | None:
        """With ``snapshot_every``: the run's id (a new one for a new run, whose stale
        snapshots from an earlier run in the same output folder are deleted) and the keeper
        (collective)."""
        if not self.config.snapshot_every:
            return None
        self.snapshot_root = snapshot_root(self.out, self.options.snapshot_dir)
        self.host = host_name(self.snapshot_root)
        self.run_id = run_id(self.out, new=new_run)
        if new_run:
            remove_other_runs(self.snapshot_root, self.run_id, [self.runtime.rank])
        hosts = gather_objects(self.host, "all_gather_object (snapshot hosts)")
        return SnapshotKeeper(
            self.snapshot_root,
            [str(h) for h in hosts],
            self.run_id,
            self._training_state(),
            self.config.snapshot_every,
            self._snapshot_extras,
        )

    def _discard_snapshots(self) -> None:
        """The run ended (its steps done, or stopped with a checkpoint newer than any
        snapshot): free the memory its snapshots take on this host."""
        if self.keeper is not None:
            self.keeper.close()
            self.keeper.discard()

    def _training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.runtime.device)

    def _snapshot_extras(self) -> dict[str, Any]:
        return {
            "data": self.data.state_dict(),
            "skipped": list(self.skipped),
            "record": self.record,
        }

    def _snapshot_fits(self, header: SnapshotHeader) -> str | None:
        """Why a snapshot cannot continue this run (its record differs in a field a resume
        cannot change), or None."""
        saved = header.extras.get("record")
        if not isinstance(saved, Mapping):
            return "it holds no run record"
        conflicts = self._conflicts(saved)
        return f"another run's settings ({'; '.join(conflicts)})" if conflicts else None

    def _conflicts(self, saved: Mapping[str, Any]) -> list[str]:
        """The settings of a saved run's record that this run differs in and cannot change on
        a resume."""
        resumable = tuple(f"{name}:" for name in _ALSO_RESUMABLE)
        return [c for c in resume_conflicts(saved, self.record) if not c.startswith(resumable)]

    def _recover(self, keeper: SnapshotKeeper) -> int | None:
        """The step restored from the snapshots (collective), or None: load from disk."""
        listing = list_checkpoints(self.checkpoints)
        disk = [int(p.name.removeprefix("step_")) for p in listing.checkpoints]
        got = recover_from_snapshots(
            keeper.root,
            self.host,
            self.run_id,
            self._training_state(),
            max(disk) if disk else None,
            self._snapshot_fits,
        )
        for problem in got.skipped:
            self.log.warning("recovery: skipped snapshot %s", problem)
        if got.header is None:
            self.log.info("recovery: no snapshot to take (%s)", got.plan.describe())
            return None
        extras = got.header.extras
        self.data.load_state_dict(extras["data"])
        self.skipped = [int(s) for s in extras["skipped"]]
        self.log.info("recovery: %s in %.2f s", got.plan.describe(), got.seconds)
        return got.plan.step

    def _load(self, path: Path) -> int:
        """Load ``path`` after checking that its run is this one's (collective); its step."""
        saved = read_record(path)
        if saved is not None:
            conflicts = self._conflicts(saved)
            if conflicts:
                raise ConfigError(
                    f"--resume: {path} was written by a run this one cannot continue; these "
                    f"settings differ (checkpoint -> now): {'; '.join(conflicts)}. Use the "
                    "checkpoint's values (its config.toml works with --config) or another --out"
                )
        data_state, skipped = _text_state(path)
        step = load_checkpoint(path, self.model, self.optimizer, self.stage_of)
        if data_state is not None:
            self.data.load_state_dict(data_state)
        if skipped is not None:
            self.skipped = skipped
        self.log.info("resumed from %s (step %d)", path, step)
        return step

    def _resume_newest(self) -> int:
        """Load the newest checkpoint of ``out/checkpoints`` that verifies and loads, each one
        skipped logged with its problem (collective); 0 when there is none at all and
        ``resume_if_present`` asks for a fresh start."""
        found = list_checkpoints(self.checkpoints)
        if not found.checkpoints:
            return self._nothing_to_resume(found)
        skipped: list[str] = []
        for path in found.checkpoints:
            verdict = verify_checkpoint(path)
            if not verdict.ok:
                problem = "; ".join(verdict.problems)
            else:
                self._note_unverified(verdict)
                try:
                    return self._load(path)
                except CheckpointLoadError as exc:
                    # Every rank raised it (load_checkpoint agrees): all go on to the same one.
                    problem = f"it verified but did not load ({exc.causes})"
            self.log.warning(
                "--resume: skipping checkpoint %s: %s; trying the next older one", path, problem
            )
            skipped.append(f"{path}: {problem}")
        raise CheckpointCorruptError(
            f"--resume: no checkpoint in {self.checkpoints} verifies ("
            + "; ".join(skipped)
            + "). Put a good copy back and pass it with --resume-from, or start over "
            "without --resume"
        )

    def _nothing_to_resume(self, found: CheckpointListing) -> int:
        """No checkpoint to resume from: 0 with ``resume_if_present``, else ConfigError."""
        unfinished = ""
        if found.partial:
            names = ", ".join(p.name for p in found.partial)
            unfinished = (
                f" (only {names}: a save that never finished, since a job stopped while "
                "writing it; never resumed from)"
            )
        if self.options.resume_if_present:
            self.log.info(
                "--resume-if-present: no checkpoint in %s%s; starting at step 0",
                self.checkpoints,
                unfinished,
            )
            return 0
        raise ConfigError(
            f"--resume: no checkpoint to resume from in {self.checkpoints}{unfinished}; leave "
            "--resume out to start a new run, or pass --resume-if-present to start one when "
            "there is nothing to resume"
        )

    def _chosen_checkpoint(self, path: Path) -> Path:
        """``resume_from``, verified (collective)."""
        if not path.is_dir():
            raise ConfigError(f"--resume-from {path}: no such checkpoint directory")
        inside = checkpoints_newest_first(path)
        if not (path / ".metadata").exists() and inside:
            raise ConfigError(
                f"--resume-from {path} is a folder of checkpoints, not one: pass one of them "
                f"(the newest is {inside[0][1]}), or --resume to take the newest that verifies"
            )
        verdict = verify_checkpoint(path)
        if not verdict.ok:
            raise CheckpointCorruptError(
                f"--resume-from {path} does not verify: {'; '.join(verdict.problems)}. Pick "
                "another checkpoint (--resume takes the newest that verifies)"
            )
        self._note_unverified(verdict)
        return path

    def _note_unverified(self, verdict: Verification) -> None:
        if not verdict.verified:
            self.log.warning(
                "checkpoint %s has no manifest.json and is marked as written before hp-train "
                "checksummed its checkpoints (%s): loading it unverified (its .metadata reads "
                "and its files are long enough)",
                verdict.path,
                LEGACY_MARK,
            )

    # ------------------------------------------------------------------------------ step
    def _local_batch(self, step: int) -> Batch:
        batch = self.data.batch(
            step, self.config.global_batch, self.layout.dp_rank, self.layout.dp_size
        )
        if batch.inputs.shape[0] != self.local_batch:
            raise RuntimeError(
                f"the data gave {batch.inputs.shape[0]} sequences to this rank, expected "
                f"{self.local_batch}"
            )
        device = self.runtime.device
        return self._pipeline_columns(Batch(batch.inputs.to(device), batch.targets.to(device)))

    def _pipeline_columns(self, batch: Batch) -> Batch:
        """Under pipelining with context parallelism, this rank's columns of ``batch``, what
        the pipeline's stages take (each finds their positions itself:
        ``Transformer.column_positions``); else ``batch`` (``_loss`` shards it)."""
        if self.layout.pipeline_mesh is None or self.layout.cp_mesh is None:
            return batch
        part = shard_batch(batch, self.layout.cp_mesh)
        return Batch(part.inputs, part.targets)

    def _global_mean(self, local: float) -> float:
        """The mean over the ranks that compute a loss (the last pipeline stage's: the
        others add 0.0)."""
        reduced = torch.tensor([local], dtype=torch.float64)
        with watch("all_reduce (step loss)"):
            dist.all_reduce(reduced)
        return float(reduced) / (self.runtime.world_size // self.parallel.pp)

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The language-model loss of ``batch`` (this rank's sequences): under context
        parallelism of this rank's columns of them."""
        if self.layout.cp_mesh is None:
            return lm_loss(self.model(batch.inputs), batch.targets)
        part = shard_batch(batch, self.layout.cp_mesh)
        return lm_loss(self.model(part.inputs, positions=part.positions), part.targets)

    def _forward_backward(self, batch: Batch) -> float:
        """Forward and backward of ``batch`` in ``grad_accum`` micro-steps (FSDP divides the
        summed gradients by the micro-steps too: ``hp_train.parallel.parallelize``); their mean
        loss.
        Under HSDP the replicas' all-reduce waits for the last micro-step."""
        steps = self.config.grad_accum
        hsdp = steps > 1 and self.parallel.dp_replicate > 1
        total = 0.0
        inputs, targets = batch.inputs.chunk(steps), batch.targets.chunk(steps)
        for index, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            if hsdp:
                self.model.set_requires_all_reduce(index == steps - 1)  # type: ignore[operator]
            loss = self._loss(Batch(x, y))
            loss.backward()
            total += loss.item()
        return total / steps

    def _pipeline_forward_backward(self, batch: Batch) -> float:
        """Forward and backward of ``batch`` through the pipeline in ``grad_accum`` pipeline
        steps (each one the schedule over all its microbatches; FSDP divides the summed
        gradients by the steps, as without pipelining); this rank's mean loss (0.0 off the
        last stage). Under HSDP the replicas' all-reduce waits for the last step's last
        microbatch."""
        assert self.pipeline is not None
        steps = self.config.grad_accum
        total = 0.0
        inputs, targets = batch.inputs.chunk(steps), batch.targets.chunk(steps)
        for index, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            total += self.pipeline.step(x, y, final=index == steps - 1)
        return total / steps

    def train_step(self, step: int, monitored: bool) -> dict[str, Any]:
        """Forward, backward and optimizer step of ``step``; its metrics record.

        Before the optimizer step the global loss and gradients are checked (one all-reduce
        with the loss's; the gradient norm too where it is computed): a non-finite one stops
        the run, or with ``skip_nonfinite`` skips the step (gradients dropped, no optimizer
        step; the LR schedule, a function of the step, and the data move on).

        Raises:
            NonFiniteError: a non-finite loss or gradient (more than ``skip_nonfinite`` times,
                or with a non-finite parameter, where skipping cannot help); on every rank.
        """
        batch = self._local_batch(step)
        if self.pipeline is None:
            local_lm = self._forward_backward(batch)
        else:
            local_lm = self._pipeline_forward_backward(batch)
        # Steps are 1-based in the record, as on the console and in the plot.
        lrs = dict(zip(self.group_names, self.schedule.get_last_lr(), strict=True))
        record: dict[str, Any] = {"step": step + 1, "lr": lrs}
        aux = self._aux_loss()
        if aux is not None:
            record["moe_aux_loss"] = aux
        record["loss"], bad_grads = self._global_loss(local_lm)
        finite = math.isfinite(record["loss"]) and not bad_grads
        if finite:
            if self.config.clip_grad_norm > 0:
                record["grad_norm"] = self._clip(self.config.clip_grad_norm)
            elif monitored:
                record["grad_norm"] = self._grad_norm()
            finite = math.isfinite(record.get("grad_norm", 0.0))
        if finite:
            before = snapshot(self.model) if monitored else None
            self.stepper.step()
            self.schedule.step()
            if monitored:
                record["layers"] = {k: asdict(v) for k, v in self._layer_norms(before).items()}
        else:
            self._skip_or_stop(step, record, bad_grads)
            with warnings.catch_warnings():
                # A skipped first step steps the schedule before the optimizer, on purpose.
                warnings.filterwarnings(
                    "ignore", "Detected call of `lr_scheduler.step", UserWarning
                )
                self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        if monitored:
            self._monitor(record, local_lm, warn=finite)
        return record

    def _snapshot(self, step: int) -> float | None:
        """The in-memory snapshot after ``step`` (every ``snapshot_every`` steps; none when the
        ranks stop on a signal, which writes a checkpoint instead), taken once the step's
        record is written: a restart that recovers a snapshot then never lacks the record of
        a step the snapshot holds. Returns what the copy took (ms), or None without one."""
        if self.keeper is None or self.stop_signal is not None:
            return None
        if self.keeper.after_step(step + 1):
            return self.keeper.costs.copy[-1] * 1e3
        return None

    def _global_loss(self, local: float) -> tuple[float, int]:
        """:meth:`_global_mean` of the local loss and the number of non-finite gradient
        pieces over all ranks, in one all-reduce; the same all-reduce counts the ranks that
        got a stop signal (:attr:`stop_signal`: the one every rank stops on after this step)."""
        bad = count_nonfinite(p.grad for p in self.model.parameters())
        got = None if self.signals is None else self.signals.signum
        reduced = torch.tensor(
            [local, float(bad), float(got == signal.SIGTERM), float(got == signal.SIGINT)],
            dtype=torch.float64,
        )
        with watch("all_reduce (step loss)"):
            dist.all_reduce(reduced)
        if reduced[2] > 0 or reduced[3] > 0:
            self.stop_signal = signal.SIGTERM if reduced[2] > 0 else signal.SIGINT
            if self.signals is not None:
                self.signals.acknowledge()
        return float(reduced[0]) / (self.runtime.world_size // self.parallel.pp), int(reduced[1])

    def _stage(self) -> int:
        return 0 if self.pipeline is None else self.pipeline.stage

    def _skip_or_stop(self, step: int, record: dict[str, Any], bad_grads: int) -> None:
        """A step whose loss or gradients are non-finite: name the first non-finite tensor
        (collective), then count the skip or raise :class:`NonFiniteError`."""
        report = first_nonfinite(self.model, self._stage())
        found = []
        if not math.isfinite(record["loss"]):
            found.append(f"the global loss is {record['loss']}")
        if bad_grads:
            found.append(f"{bad_grads} gradient piece(s) over the ranks are non-finite")
        elif "grad_norm" in record:
            found.append(f"the global gradient norm is {record['grad_norm']}")
        # 1-based, as the console's step lines and metrics.jsonl count.
        what = f"step {step + 1}: {' and '.join(found)}; {report.describe()}"
        record["nonfinite_at"] = None if report.first is None else report.first.describe()
        limit = self.config.skip_nonfinite
        if limit and report.parameter is None and len(self.skipped) < limit:
            self.skipped.append(step)
            record["skipped"] = True
            record["skipped_steps"] = len(self.skipped)
            self.log.warning(
                "%s: skipped the step, no optimizer step (%d of at most %d, --skip-nonfinite)",
                what,
                len(self.skipped),
                limit,
            )
            return
        if report.parameter is not None:
            why = "the weights themselves are non-finite, which skipping a step cannot mend"
        elif limit:
            skipped = [s + 1 for s in self.skipped]  # 1-based, as the message's step
            why = f"more than --skip-nonfinite {limit} steps were non-finite ({skipped})"
        else:
            why = "stopped before the optimizer step applied it"
        latest = latest_checkpoint(self.checkpoints)
        raise NonFiniteError(
            f"{what}; {why}. No checkpoint holds non-finite state (the latest is "
            f"{'none' if latest is None else latest[1]}). Lower the learning rate, clip with "
            "--clip-grad-norm, or skip such steps with --skip-nonfinite N",
            step,
            report,
            record,
        )

    def _clip(self, max_norm: float) -> float:
        """Scale every gradient so that the global norm is at most ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_``); the norm before clipping."""
        norm = self._grad_norm()
        clip_grads_to_norm_(self.model.parameters(), norm, max_norm)
        return norm

    def _aux_loss(self) -> float | None:
        """The MoE load-balancing loss of the last forward (summed over the pipeline's
        stages)."""
        aux = self.model.aux_loss()
        if self.pipeline is None:
            return None if aux is None else float(aux)
        # Collective over the stages: a stage without MoE layers adds zero.
        total = torch.zeros((), dtype=torch.float64)
        if aux is not None:
            total += aux.detach().double().cpu()
        has_moe = torch.tensor(float(aux is not None), dtype=torch.float64)
        both = torch.stack([total, has_moe])
        with watch("all_reduce (pipeline loss)", self.pipeline.pp_group):
            dist.all_reduce(both, group=self.pipeline.pp_group)
        return float(both[0]) if float(both[1]) > 0 else None

    def _layer_norms(self, before: dict[str, torch.Tensor] | None) -> dict[str, LayerNorms]:
        """Per layer, the norms of the whole tensors over the ranks
        (:func:`~hp_train.observe.layer_norms.global_layer_norms`), every stage's layers
        under pipeline parallelism (collective)."""
        norms = global_layer_norms(self.model, before)
        if self.pipeline is None:
            return norms
        merged: dict[str, LayerNorms] = {}
        for stage in gather_objects(norms, "all_gather_object (per-layer norms of the stages)"):
            merged.update(stage)  # type: ignore[call-overload]
        return dict(sorted(merged.items()))

    def _grad_norm(self) -> float:
        """The global gradient norm; the pipeline's stages hold disjoint parameters, so their
        squared norms add."""
        norm = global_grad_norm(self.model)
        if self.pipeline is None:
            return norm
        square = torch.tensor(norm * norm, dtype=torch.float64)
        with watch("all_reduce (pipeline gradient norm)", self.pipeline.pp_group):
            dist.all_reduce(square, group=self.pipeline.pp_group)
        return math.sqrt(float(square))

    def _monitor(self, record: dict[str, Any], local_lm: float, warn: bool = True) -> None:
        """Per-rank training losses, every rank's loss on the step's shared probe batch (a
        warning names each rank off the consensus, :mod:`hp_train.observe.monitor`, unless
        ``warn`` is off: a skipped non-finite step was reported already) and peak memory into
        ``record``. Under pipeline parallelism the probe runs through the forward-only
        schedule and the last stage's ranks report it (the others compute none)."""
        key = 0 if self.layout.cp_mesh is None else self.layout.cp_mesh.get_local_rank(0)
        # A training micro-step's shape without pipelining; under it the evaluation's (the
        # forward-only schedule keeps the shapes of its first batch).
        rows = self.local_batch // (self.config.grad_accum if self.pipeline is None else 1)
        inputs, targets = probe_batch(
            self.model_config.vocab_size,
            rows,
            self.config.seq_len,
            self.config.seed,
            int(record["step"]),
        )
        (probe,) = self._forward_only_losses([Batch(inputs, targets)])
        record["rank_losses"], probes, keys = gather_probes(local_lm, probe, key)
        record["probe_losses"] = probes
        for d in probe_divergences(probes, keys, self.config.divergence_threshold):
            if self.is_main and warn:
                # The run's own report, not a warnings.warn that a process-wide filter can hide.
                self.log.warning("%s", d.message())
        peaks: list[object] = [None] * self.runtime.world_size
        with watch("all_gather_object (peak memory per rank)"):
            dist.all_gather_object(peaks, peak_memory_bytes(self.runtime.device))
        record["peak_memory_bytes"] = peaks

    # -------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over the held-out batches (the same ones at every evaluation)."""
        batches = self.data.eval_batches(
            self.config.global_batch,
            self.layout.dp_rank,
            self.layout.dp_size,
            self.config.eval_batches,
        )
        if not batches:
            raise ConfigError(
                "the held-out data gives no batch: raise eval_fraction or pass a larger eval_data"
            )
        losses = self._forward_only_losses(batches)
        if self.pipeline is not None and not self.pipeline.is_last:
            return self._global_mean(0.0)
        return self._global_mean(sum(v for v in losses if v is not None) / len(batches))

    @torch.no_grad()
    def _forward_only_losses(self, batches: Sequence[Batch]) -> list[float | None]:
        """The loss of each of ``batches`` in evaluation mode (no dropout, and none of
        training's random numbers drawn), forward only; under pipeline parallelism through
        the forward-only schedule, None on the ranks off the last stage.

        Postcondition: every FSDP module is resharded, as after a training step. A forward
        without backward leaves the root's parameters (and any kept unsharded after forward)
        gathered, since only backward reshards them (as in torch FSDP2, whose ``reshard()``
        this calls too); a snapshot or checkpoint taken next must see the sharded layout.
        """
        device = self.runtime.device
        losses: list[float | None] = []
        self.model.eval()
        try:
            for batch in batches:
                inputs, targets = batch.inputs.to(device), batch.targets.to(device)
                if self.pipeline is not None:
                    part = self._pipeline_columns(Batch(inputs, targets))
                    losses.append(self.pipeline.forward_losses(part.inputs, part.targets))
                else:
                    losses.append(float(self._loss(Batch(inputs, targets))))
        finally:
            self.model.train()
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return losses

    # ------------------------------------------------------------------------------ save
    def save(self, step: int) -> Path:
        """A checkpoint after ``step`` steps, with the data position and the configuration
        (collective).

        Raises:
            NonFiniteError: a parameter or optimizer state tensor is non-finite (an optimizer
                step of finite gradients overflowed); nothing is written.
            CheckpointWriteError: a rank could not write (the earlier checkpoints stay).
        """
        bad = torch.tensor([float(nonfinite_state(self.model, self.optimizer))])
        with watch("all_reduce (non-finite state check)"):
            dist.all_reduce(bad)
        if float(bad):
            report = first_nonfinite(self.model, self._stage(), self.optimizer)
            raise NonFiniteError(
                f"after step {step}: {report.describe()}; not writing checkpoint "
                f"step_{step:06d} from non-finite state. Lower the learning rate or clip "
                "with --clip-grad-norm",
                step - 1,
                report,
            )
        files = {
            DATA_STATE_FILE: json.dumps(self.data.state_dict()),
            RECORD_FILE: json.dumps(self.record, indent=1),
            SKIPPED_FILE: json.dumps({"skipped_steps": self.skipped}),
        }
        if self.options.options is not None:
            files[CONFIG_FILE] = dump_toml(self.options.options)
        files.update(checkpoint_files(self.options.init_from, self.tokenizer))  # HF export
        return save_checkpoint(
            self.checkpoints, step, self.model, self.optimizer, self.stage_of, files
        )

    # ------------------------------------------------------------------------------- run
    def run(self) -> Summary:
        """Build, resume, train to ``config.steps``, report (collective). Every rank's log
        ends with the run's end line, or the error or signal that stopped it
        (:mod:`hp_train.observe.run_header`).

        Raises:
            StoppedBySignalError: ``stop_on_signals`` and a SIGTERM or SIGINT: every rank
                finished the same step and the checkpoint of it is written.
        """
        try:
            return self._run()
        except (NonFiniteError, CheckpointError) as exc:
            self.log.error("%s", exc)
            self._log_stop(exc)
            raise
        except StoppedBySignalError as exc:
            self.log.warning("%s", exc)
            self._log_stop(exc)
            raise
        except BaseException as exc:
            self._log_stop(exc)
            raise
        finally:
            close_logging()

    def _run(self) -> Summary:
        self.build()
        start = self.resume()
        self.stepper = self._stepper()
        self.schedule = build_schedule(self.optimizer, self.config, start)
        loop = self._open_loop(start)
        if self.options.stop_on_signals:
            # Only around the loop: before the first step there is nothing new to save.
            self.signals = StopSignals(grace=lambda: _GRACE_STEPS * max(loop.times, default=0.0))
            self.signals.__enter__()
        try:
            for step in range(start, self.config.steps):
                self.current_step = step
                record = self._step(step, loop)
                if self.stop_signal is not None:
                    self._discard_snapshots()
                    raise StoppedBySignalError(self.stop_signal, step + 1, record["checkpoint"])
            self.current_step = None
            self._discard_snapshots()
        finally:
            if self.signals is not None:
                self.signals.__exit__(None, None, None)
            loop.close()
        summary = self._summary(start, loop)
        self.log.info("%s", end_line(self._summary_text(summary)), extra=FILE_ONLY)
        return summary

    def _open_loop(self, start: int) -> _Loop:
        """The step loop's writers: ``metrics.jsonl`` (rank 0; a new run's replaces an old
        one, a resumed run's appends), TensorBoard's events, the progress bar (rank 0, on a
        terminal only: elsewhere the step lines tell the progress)."""
        metrics_path = self.out / "metrics.jsonl"
        if self.is_main and start == 0:
            # A new run (checkpoints are of steps >= 1); a resumed one appends.
            metrics_path.unlink(missing_ok=True)
        tty = console_is_terminal()
        return _Loop(
            metrics=MetricsWriter(metrics_path) if self.is_main else None,
            board=self._tensorboard(start),
            bar=ProgressBar(enabled=self.is_main and not self.options.quiet and tty),
            tty=tty,
            first=start,
            observers=self._observers(start),
        )

    def _observers(self, start: int) -> StepObservers:
        """The steps' profiler, memory measurement and W&B run, as the options ask."""
        options = self.options
        return open_step_observers(
            self.out,
            rank=self.runtime.rank,
            device=self.runtime.device,
            model=self.model,
            optimizer=self.optimizer,
            profile_steps=options.profile_steps,
            memory_steps=options.memory_snapshot_steps,
            wandb_project=options.wandb_project if options.wandb else None,
            wandb_config=options.options or {},
            resume_step=start or None,
        )

    def _step(self, step: int, loop: _Loop) -> dict[str, Any]:
        """Train ``step`` (0-based), then evaluate, checkpoint, write and show its record as
        the configuration asks; the record. Monitored, with a step line: every
        ``log_every``-th step (1-based), the last, and the first of this invocation (a batch
        log shows at once that the run trains, and what a step costs)."""
        config = self.config
        began = time.perf_counter()
        last = step == config.steps - 1
        monitored = (step + 1) % config.log_every == 0 or last or step == loop.first
        loop.observers.begin(step + 1)
        try:
            record = self.train_step(step, monitored=monitored)
        except NonFiniteError as exc:
            if loop.metrics is not None and exc.record is not None:
                loop.metrics.write(exc.record)
            raise
        elapsed = time.perf_counter() - began
        for line in loop.observers.end(step + 1):
            self.log.info("%s", line)
        loop.times.append(elapsed)
        loop.losses[step] = record["loss"]
        self._performance(record, elapsed)
        self._evaluate_into(step, last, record, loop)
        if config.checkpoint_every and ((step + 1) % config.checkpoint_every == 0 or last):
            # The last step too, whatever checkpoint_every: a finished run can be continued.
            loop.last_checkpoint = str(self.save(step + 1))
            record["checkpoint"] = loop.last_checkpoint
        if self.stop_signal is not None:
            record["stopped_by"] = signal.Signals(self.stop_signal).name
            if record.get("checkpoint") is None:
                record["checkpoint"] = str(self.save(step + 1))
        if loop.snapshot_ms is not None:
            record["snapshot_ms"] = loop.snapshot_ms  # the copy after the previous step
        if loop.metrics is not None:
            loop.metrics.write(record)
        loop.snapshot_ms = self._snapshot(step)
        if loop.board is not None:
            loop.board.scalars(step + 1, _board_values(record))
        loop.observers.scalars(step + 1, _board_values(record))
        loop.bar.update(
            step + 1, config.steps, loss=record["loss"], tok_s=record["tokens_per_s"],
            step_ms=elapsed * 1e3,
        )  # fmt: skip
        if monitored:
            self._log_step(record, loop.tty)
        return record

    def _performance(self, record: dict[str, Any], elapsed: float) -> None:
        """Step time, throughput, FLOPs and MFU into ``record``; the per-rank memory figure
        under the key that says what it measures (``peak_rss_bytes`` on CPU,
        ``peak_allocated_bytes`` on an accelerator)."""
        record.update(step_time_s=elapsed, tokens_per_s=self.tokens_per_step / elapsed)
        record["flops_per_token"] = self.flops_per_token
        record["mfu"] = mfu(
            self.flops_per_token,
            self.tokens_per_step,
            elapsed,
            self.runtime.world_size,
            self.peak.flops,
        )
        if "peak_memory_bytes" in record:  # _monitor's figure, by rank
            record[self.memory_key] = record.pop("peak_memory_bytes")

    def _evaluate_into(self, step: int, last: bool, record: dict[str, Any], loop: _Loop) -> None:
        every = self.config.eval_every
        if not (every and ((step + 1) % every == 0 or last)):
            return
        eval_loss = self.evaluate()
        loop.eval_losses[step] = eval_loss
        record.update(eval_loss=eval_loss, eval_perplexity=_perplexity(eval_loss))
        self.log.info(
            "step %d: eval loss %.4f (perplexity %.2f)",
            step + 1,
            eval_loss,
            _perplexity(eval_loss),
        )

    def _log_step(self, record: Mapping[str, Any], tty: bool) -> None:
        """The step line (:mod:`hp_train.observe.step_line`) into the log file, and on rank
        0's console unless that is a terminal showing the progress bar; the memory figure is
        this rank's."""
        own = peak_memory_bytes(self.runtime.device)
        aux = record.get("moe_aux_loss")
        figures = StepFigures(
            step=int(record["step"]),
            total=self.config.steps,
            loss=float(record["loss"]),
            lr=record["lr"],
            grad_norm=record.get("grad_norm"),
            tokens_per_s=float(record["tokens_per_s"]),
            step_time_s=float(record["step_time_s"]),
            mfu=record.get("mfu"),
            memory=None if own is None else (MEMORY_LABELS[self.memory_key], own),
            extra={} if aux is None else {"aux loss": float(aux)},
        )
        self.log.info("%s", step_line(figures), extra={CONSOLE: not tty})

    def _stepper(self) -> torch.optim.Optimizer | OffloadedOptimizer:
        """What steps the parameters: the optimizer, or with ``offload`` of the optimizer an
        ``hp_offload.OffloadedOptimizer`` around it (made after a resume loaded the state,
        which it then moves to host memory; the schedule and checkpoints keep using the
        wrapped optimizer, whose groups and state are the same objects)."""
        if self.config.offload not in ("optimizer", "both"):
            return self.optimizer
        return OffloadedOptimizer(self.optimizer, device=self.runtime.device)

    def _tensorboard(self, start: int) -> TensorBoardLog | None:
        if not self.options.tensorboard or not self.is_main:
            return None
        # A resumed run hides what the interrupted one logged after its checkpoint (its steps
        # are 1-based: the first the resumed run writes is start + 1).
        return open_tensorboard(self.out / "tensorboard", purge_step=start + 1 if start else None)

    def _summary(self, start: int, loop: _Loop) -> Summary:
        peaks: list[object] = [None] * self.runtime.world_size
        with watch("all_gather_object (peak memory per rank)"):
            dist.all_gather_object(peaks, peak_memory_bytes(self.runtime.device))
        times = loop.times
        median = sorted(times)[len(times) // 2] if times else math.nan
        if self.is_main and loop.losses:
            self._plot()
        return Summary(
            losses=loop.losses,
            first_step=start,
            tokens_per_s=self.tokens_per_step / median if times else math.nan,
            step_time_s=median,
            peak_memory_bytes=[p if isinstance(p, int) else None for p in peaks],
            checkpoint=loop.last_checkpoint,
            eval_losses=loop.eval_losses,
            skipped_steps=list(self.skipped),
            mfu=mfu(
                self.flops_per_token,
                self.tokens_per_step,
                median,
                self.runtime.world_size,
                self.peak.flops,
            ),
            memory_label=MEMORY_LABELS[self.memory_key],
        )

    def _summary_text(self, summary: Summary) -> str:
        """The end line's summary: steps, loss, median step time, throughput, MFU, memory."""
        if not summary.losses:
            return f"no step to run (the run was at step {summary.first_step} already)"
        steps = sorted(summary.losses)
        first, last = summary.losses[steps[0]], summary.losses[steps[-1]]
        peaks = ", ".join(
            "n/a" if p is None else f"{p / 2**20:.0f}" for p in summary.peak_memory_bytes
        )
        utilization = (
            "MFU n/a" if summary.mfu is None else f"MFU {format_number(summary.mfu * 100)}%"
        )
        return (
            f"{len(steps)} steps ({steps[0] + 1} to {steps[-1] + 1} of {self.config.steps}), "
            f"loss {first:.4f} -> {last:.4f}, median step "
            f"{format_number(summary.step_time_s * 1e3)} ms, "
            f"{format_number(summary.tokens_per_s)} tokens/s, {utilization}, "
            f"{summary.memory_label} per rank (MiB) {peaks}"
            + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        )

    def _plot(self) -> None:
        """``loss.png`` of the whole run so far (a resumed run's earlier steps included;
        ``metrics.jsonl``'s steps are 1-based, as the plot's)."""
        train_curve: dict[int, float] = {}
        eval_curve: dict[int, float] = {}
        for record in read_metrics(self.out / "metrics.jsonl"):
            step = int(str(record["step"]))
            train_curve[step] = _as_float(record["loss"])
            if "eval_loss" in record:
                eval_curve[step] = _as_float(record["eval_loss"])
        series = {"train loss": [(float(s), v) for s, v in sorted(train_curve.items())]}
        if eval_curve:
            series["eval loss"] = [(float(s), v) for s, v in sorted(eval_curve.items())]
        write_curves(
            self.out / "loss.png", series, title="training loss", x_label="step", y_label="loss"
        )


def _text_state(path: Path) -> tuple[dict[str, Any] | None, list[int] | None]:
    """A checkpoint's data position and skipped steps (None: not in it), as rank 0 reads them
    (collective: one broadcast, so every rank takes the same, or skips the checkpoint alike);
    read before its tensors load, so that a damaged file skips the checkpoint before any
    state changes.

    Raises:
        CheckpointLoadError: a file is there but not what this version writes.
    """

    def read() -> tuple[dict[str, Any] | None, list[int] | None] | str:
        data_state: dict[str, Any] | None = None
        skipped: list[int] | None = None
        try:
            state_file = path / DATA_STATE_FILE
            if state_file.is_file():
                data_state = json.loads(state_file.read_text())
                if not isinstance(data_state, dict):
                    raise ValueError(f"{DATA_STATE_FILE} holds no JSON object")
            skipped_file = path / SKIPPED_FILE
            if skipped_file.is_file():
                skipped = [int(s) for s in json.loads(skipped_file.read_text())["skipped_steps"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"rank 0: {type(exc).__name__}: {exc}"
        return data_state, skipped

    box: list[object] = [read() if dist.get_rank() == 0 else None]
    with watch("checkpoint text state broadcast"):
        dist.broadcast_object_list(box, src=0)
    found = box[0]
    if isinstance(found, str):
        raise CheckpointLoadError(path, found)
    assert isinstance(found, tuple)
    return found


def _as_float(value: object) -> float:
    return float(value) if isinstance(value, int | float | str) else math.nan


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _board_values(record: Mapping[str, Any]) -> dict[str, float | None]:
    """TensorBoard's scalars of a metrics record (the learning rate per parameter group, by
    its name; the memory figure under the tag of what it measures)."""
    values: dict[str, float | None] = {
        TRAIN_LOSS: record["loss"],
        MOE_AUX_LOSS: record.get("moe_aux_loss"),
        EVAL_LOSS: record.get("eval_loss"),
        EVAL_PERPLEXITY: record.get("eval_perplexity"),
        GRAD_NORM: record.get("grad_norm"),
        TOKENS_PER_S: record["tokens_per_s"],
        STEP_TIME_S: record["step_time_s"],
        MFU: record.get("mfu"),
    }
    memory = per_rank_memory(record)
    if memory is not None and memory[0] in MEMORY_TAGS:
        values[MEMORY_TAGS[memory[0]]] = peak_mib(memory[1])
    for group, lr in record["lr"].items():
        values[lr_tag(group)] = float(lr)
    return values


def group_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """A name per parameter group of ``optimizer``, in ``param_groups`` order: the lower-case
    class name of the optimizer that owns the group (``muon``, ``adamw``: a chained
    optimizer's parts, ``hp_muon.ChainedOptimizer.optimizers``), with ``_<i>`` after it
    (from 1) where one optimizer has several groups."""
    parts = getattr(optimizer, "optimizers", None) or (optimizer,)
    names: list[str] = []
    for part in parts:
        base = type(part).__name__.lower()
        count = len(part.param_groups)
        names += [base] if count == 1 else [f"{base}_{i}" for i in range(1, count + 1)]
    if len(names) != len(optimizer.param_groups):
        raise ValueError(
            f"{type(optimizer).__name__} has {len(optimizer.param_groups)} parameter groups "
            f"but its parts name {len(names)} ({names})"
        )
    return names


def train(
    model_config: ModelConfig,
    parallel: ParallelConfig,
    config: TrainConfig,
    options: RunOptions,
    runtime: Runtime,
) -> Summary:
    """Train (collective: every rank calls it with the same arguments): ``Trainer(...).run()``."""
    return Trainer(model_config, parallel, config, options, runtime).run()
