"""The training loop: build, (validate,) resume, train, monitor, checkpoint, report.

Every rank runs :func:`train` with the same arguments. Rank 0 prints the progress bar and the
summary and writes ``metrics.jsonl`` and ``loss.png`` into the output directory; checkpoints
go to ``<out>/checkpoints``.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_layout import Mesh
from hp_train.checkpoint import StageOf, latest_checkpoint, load_checkpoint, save_checkpoint
from hp_train.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.data import Batch, TokenSource, make_source
from hp_train.metrics import MetricsWriter, peak_memory_bytes
from hp_train.model import Transformer, lm_loss
from hp_train.monitor import (
    divergent_ranks,
    global_grad_norm,
    local_norms,
    rank_losses,
    snapshot,
)
from hp_train.optim import build_optimizer, build_schedule
from hp_train.parallelize import Layout3D, build_layout, check_model_fits, parallelize, tp_plan
from hp_train.pipeline import (
    PipelineRunner,
    build_pipeline,
    keep_stage,
    stage_boundaries,
)
from hp_train.plot import write_line_plot_png
from hp_train.progress import ProgressBar
from hp_train.runtime import Runtime

__all__ = ["RunOptions", "Summary", "train"]


@dataclass(frozen=True)
class RunOptions:
    """Where a run writes and what it does besides training.

    Attributes:
        out_dir: metrics, plot and checkpoints.
        resume: continue from the latest complete checkpoint in ``out_dir/checkpoints``.
        validate: before training, run the tensor-parallel plan in validation mode against a
            single-device run for ``validate_steps`` steps (raises on the first mismatch).
        validate_steps: steps of that check.
        quiet: no progress bar.
    """

    out_dir: Path
    resume: bool = False
    validate: bool = False
    validate_steps: int = 2
    quiet: bool = False


@dataclass(frozen=True)
class Summary:
    """What a run did (identical on every rank).

    Attributes:
        losses: global loss of every step run by this invocation, by step.
        first_step: the step this invocation started at (> 0 after a resume).
        tokens_per_s: median tokens per second over the steps (all ranks together).
        step_time_s: median step time.
        peak_memory_bytes: per rank (see :func:`hp_train.metrics.peak_memory_bytes`).
        checkpoint: the last checkpoint written, if any.
    """

    losses: dict[int, float]
    first_step: int
    tokens_per_s: float
    step_time_s: float
    peak_memory_bytes: list[int | None]
    checkpoint: str | None


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


def _loss(model: Transformer, batch: Batch) -> tuple[torch.Tensor, float]:
    """The language-model loss (MoE load-balancing losses enter through the MoE blocks'
    backward, weighted by ``MoEConfig.aux_loss_weight``)."""
    logits = model(batch.inputs)
    lm = lm_loss(logits, batch.targets)
    return lm, lm.item()


def _validate(
    model_config: ModelConfig,
    layout: Layout3D,
    source: TokenSource,
    config: TrainConfig,
    steps: int,
    device: torch.device,
) -> str:
    from hp_dtensor.parallel.equivalence import assert_equivalent

    if layout.tp_size == 1:
        return "--validate: tp=1, no tensor-parallel plan to validate"
    if model_config.moe is not None:
        raise ConfigError(
            "--validate supports dense models: MoE layers need expert-parallel sharding rules "
            "(hp-dtensor's expert parallelism has not landed)"
        )
    batches = []
    for step in range(steps):
        whole = source.global_batch(step, config.global_batch)
        batches.append((whole.inputs.to(device), whole.targets.to(device)))

    def build() -> Transformer:
        return Transformer(model_config).to(device)

    # Validation mode treats every data axis as one (the plan's gradients are Partial over
    # them until reduced): one "dp" axis of all data-parallel ranks, or none. The check is of
    # the tensor-parallel plan, so pipeline ranks join the data axis (whole models there).
    data_ranks = dist.get_world_size() // layout.tp_size
    if config.global_batch % data_ranks:
        raise ConfigError(
            f"--validate runs the whole model on {data_ranks} data-parallel x {layout.tp_size} "
            f"tensor-parallel ranks: global_batch={config.global_batch} must be divisible by "
            f"{data_ranks}"
        )
    if data_ranks > 1:
        mesh = DeviceMesh(device.type, Mesh((data_ranks, layout.tp_size), ("dp", "tp")))
        dp_axes: tuple[str, ...] = ("dp",)
    else:
        mesh = DeviceMesh(device.type, Mesh((layout.tp_size,), ("tp",)))
        dp_axes = ()
    report = assert_equivalent(
        build,
        tp_plan(model_config),
        mesh,
        batches,
        mode="validation",
        tp_axis="tp",
        dp_axes=dp_axes,
        seed=config.seed,
        # Plain SGD between the checked steps: the gradients must agree to rounding, and
        # Adam's division by the root mean square would blow up the rounding of tiny ones.
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return (
        f"--validate: {steps} steps in validation mode match one device (loss error "
        f"{report.loss_error:.2g}, worst gradient {report.grad_error:.2g} at {report.worst_grad})"
    )


def _aux_loss(model: Transformer, pipeline: PipelineRunner | None) -> float | None:
    """The MoE load-balancing loss of the last forward (summed over the pipeline's stages)."""
    aux = model.aux_loss()
    if pipeline is None:
        return None if aux is None else float(aux)
    # Collective over the stages: a stage without MoE layers adds zero.
    total = torch.zeros((), dtype=torch.float64)
    if aux is not None:
        total += aux.detach().double().cpu()
    has_moe = torch.tensor(float(aux is not None), dtype=torch.float64)
    both = torch.stack([total, has_moe])
    dist.all_reduce(both, group=pipeline.pp_group)
    return float(both[0]) if float(both[1]) > 0 else None


def _grad_norm(model: Transformer, pipeline: PipelineRunner | None) -> float:
    """The global gradient norm; the pipeline's stages hold disjoint parameters, so their
    squared norms add."""
    norm = global_grad_norm(model)
    if pipeline is None:
        return norm
    square = torch.tensor(norm * norm, dtype=torch.float64)
    dist.all_reduce(square, group=pipeline.pp_group)
    return math.sqrt(float(square))


def _loss_ranks(layout: Layout3D, parallel: ParallelConfig) -> list[int] | None:
    """The ranks that compute a loss (the last pipeline stage's), None for every rank."""
    if layout.pipeline_mesh is None:
        return None
    grid = layout.pipeline_mesh.mesh
    return [r for r in grid.ranks if grid.coordinate(r)[0] == parallel.pp - 1]


def train(
    model_config: ModelConfig,
    parallel: ParallelConfig,
    config: TrainConfig,
    options: RunOptions,
    runtime: Runtime,
) -> Summary:
    """Train (collective: every rank calls it with the same arguments)."""
    check_model_fits(model_config, parallel)
    local_batch = config.check_batch(parallel)
    _set_determinism(config)
    is_main = runtime.rank == 0
    layout = build_layout(parallel, runtime.device.type)
    source = make_source(
        config.data,
        vocab_size=model_config.vocab_size,
        seq_len=config.seq_len,
        seed=config.seed,
    )
    if config.seq_len > model_config.max_seq_len:
        raise ConfigError(
            f"seq_len={config.seq_len} exceeds the model's max_seq_len={model_config.max_seq_len}"
        )
    if options.validate:
        message = _validate(
            model_config, layout, source, config, options.validate_steps, runtime.device
        )
        if is_main:
            print(message, flush=True)

    _write_pid(options.out_dir, runtime.rank)
    torch.manual_seed(config.seed)
    with runtime.device:
        model = Transformer(model_config)
    pipeline: PipelineRunner | None = None
    if layout.pipeline_mesh is not None:
        # Every rank initializes the whole model (the same numbers as one device), then keeps
        # its stage.
        stage = layout.pipeline_mesh.mesh.coordinate(runtime.rank)[0]
        keep_stage(model, stage, stage_boundaries(model_config, parallel.pp))
    parallelize(model, layout)
    if layout.pipeline_mesh is not None:
        pipeline = build_pipeline(
            model,
            layout.pipeline_mesh,
            schedule=config.pp_schedule,
            microbatches=config.microbatches,
            device=runtime.device,
        )
    optimizer = build_optimizer(model, config)
    stage_of = None if pipeline is None else StageOf(pipeline.stage, pipeline.num_stages)
    start = 0
    checkpoints = options.out_dir / "checkpoints"
    if options.resume:
        found = latest_checkpoint(checkpoints)
        if found is not None:
            start = load_checkpoint(found[1], model, optimizer, stage_of)
            if is_main:
                print(f"resumed from {found[1]} (step {start})", flush=True)
        elif is_main:
            print(f"--resume: no complete checkpoint in {checkpoints}; starting at step 0")
    schedule = build_schedule(optimizer, config, start)

    metrics_path = options.out_dir / "metrics.jsonl"
    if is_main and not options.resume:
        metrics_path.unlink(missing_ok=True)  # a new run; a resumed one appends
    metrics = MetricsWriter(metrics_path) if is_main else None
    bar = ProgressBar(enabled=is_main and not options.quiet)
    losses: dict[int, float] = {}
    times: list[float] = []
    last_checkpoint: str | None = None
    tokens = config.global_batch * config.seq_len
    try:
        for step in range(start, config.steps):
            began = time.perf_counter()
            batch = source.local_batch(step, config.global_batch, layout.dp_rank, layout.dp_size)
            assert batch.inputs.shape[0] == local_batch
            batch = Batch(batch.inputs.to(runtime.device), batch.targets.to(runtime.device))
            monitored = step % config.log_every == 0 or step == config.steps - 1
            if pipeline is None:
                loss, local_lm = _loss(model, batch)
                loss.backward()
            else:
                local_lm = pipeline.step(batch.inputs, batch.targets)
            record: dict[str, Any] = {"step": step, "lr": schedule.get_last_lr()}
            before = None
            aux = _aux_loss(model, pipeline)
            if aux is not None:
                record["moe_aux_loss"] = aux
            if monitored:
                record["grad_norm"] = _grad_norm(model, pipeline)
                before = snapshot(model)
            optimizer.step()
            schedule.step()
            if monitored:
                record["layers"] = {k: asdict(v) for k, v in local_norms(model, before).items()}
            optimizer.zero_grad(set_to_none=True)
            reduced = torch.tensor([local_lm], dtype=torch.float64)
            dist.all_reduce(reduced)
            # Only the last pipeline stage's ranks hold a loss (the others add 0.0).
            global_loss = float(reduced) / (runtime.world_size // parallel.pp)
            losses[step] = global_loss
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            record.update(loss=global_loss, step_time_s=elapsed, tokens_per_s=tokens / elapsed)
            if monitored:
                per_rank = rank_losses(local_lm)
                record["rank_losses"] = per_rank
                holders = _loss_ranks(layout, parallel)
                for d in divergent_ranks(per_rank, config.divergence_threshold, holders):
                    if is_main:
                        warnings.warn(d.message(), stacklevel=1)
                peaks: list[object] = [None] * runtime.world_size
                dist.all_gather_object(peaks, peak_memory_bytes(runtime.device))
                record["peak_memory_bytes"] = peaks
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                last_checkpoint = str(
                    save_checkpoint(checkpoints, step + 1, model, optimizer, stage_of)
                )
                record["checkpoint"] = last_checkpoint
            if metrics is not None:
                metrics.write(record)
            bar.update(
                step + 1,
                config.steps,
                loss=global_loss,
                tok_s=tokens / elapsed,
                step_ms=elapsed * 1e3,
            )
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    peaks_final: list[object] = [None] * runtime.world_size
    dist.all_gather_object(peaks_final, peak_memory_bytes(runtime.device))
    median = sorted(times)[len(times) // 2] if times else math.nan
    summary = Summary(
        losses=losses,
        first_step=start,
        tokens_per_s=tokens / median if times else math.nan,
        step_time_s=median,
        peak_memory_bytes=[p if isinstance(p, int) else None for p in peaks_final],
        checkpoint=last_checkpoint,
    )
    if is_main and losses:
        write_line_plot_png(
            options.out_dir / "loss.png",
            {"loss": [(float(s), v) for s, v in sorted(losses.items())]},
            title="training loss",
            x_label="step",
            y_label="loss",
        )
    return summary
