"""The training loop: build, (validate,) resume, train, monitor, checkpoint, report.

Every rank runs :func:`train` with the same arguments. Rank 0 prints the progress bar and the
summary and writes ``plan.json``, ``metrics.jsonl`` and ``loss.png`` into the output directory;
checkpoints go to ``<out>/checkpoints``.

``plan.json`` is the parallel plan the run applied (hp-dtensor's
:class:`~hp_dtensor.parallel.ParallelPlan`, as :meth:`~hp_dtensor.parallel.ParallelPlan.to_dict`
gives it), written once the model is laid out and the optimizer built, before the first step
(rewritten by every start, a resume too: a resumed run may have another layout). Each parameter
carries its optimizer group (``"muon"`` or ``"adamw"``, from the optimizer the run built).
With ``tp > 1`` it is ``hp_dtensor.contract.parallel_plan_of(model)`` after
:func:`~hp_train.parallelize.parallelize`, with FSDP's flat slots where hp-fsdp records them;
with ``tp == 1`` no tensor-parallel plan is applied and it is the plan resolved on the run's
mesh with no entries (every parameter replicated over the mesh), with those flat slots. With
pipelining the file is ``{"pp": P, "stages": [plan of stage 0, ...]}``: the first rank of each
stage sends its stage's plan to rank 0, which writes the one file.

:func:`resolve_run_plans` resolves the same plans on a meta-device model without any process
(``python -m hp_train --print-plan`` prints them with :func:`plan_report`).
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
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.contract import parallel_plan_of
from hp_dtensor.parallel import ParallelPlan
from hp_layout import Mesh
from hp_muon import ChainedOptimizer
from hp_train.checkpoint import StageOf, latest_checkpoint, load_checkpoint, save_checkpoint
from hp_train.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.data import Batch, TokenSource, make_source
from hp_train.dryrun.shapes import job_mesh, planned_model
from hp_train.metrics import MetricsWriter, peak_memory_bytes, write_json
from hp_train.model import Transformer, lm_loss
from hp_train.monitor import (
    divergent_ranks,
    global_grad_norm,
    local_norms,
    rank_losses,
    snapshot,
)
from hp_train.optim import build_optimizer, build_schedule
from hp_train.parallelize import (
    Layout3D,
    build_layout,
    check_model_fits,
    parallelize,
    resolve_tp_plan,
    tp_plan,
)
from hp_train.pipeline import (
    PipelineRunner,
    build_pipeline,
    keep_stage,
    stage_boundaries,
)
from hp_train.plot import write_line_plot_png
from hp_train.progress import ProgressBar
from hp_train.runtime import Runtime

__all__ = [
    "PLAN_FILE",
    "RunOptions",
    "Summary",
    "optimizer_groups",
    "plan_report",
    "resolve_run_plans",
    "train",
]

#: The applied parallel plan, beside ``metrics.jsonl`` (see the module docstring).
PLAN_FILE = "plan.json"


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


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Each trainable parameter's optimizer, by name (``"muon"``, ``"adamw"``: the lower-cased
    class name of the optimizer holding it; a :class:`hp_muon.ChainedOptimizer` is looked
    into)."""
    parts = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else (optimizer,)
    owner = {
        id(p): type(part).__name__.lower()
        for part in parts
        for group in part.param_groups
        for p in group["params"]
    }
    return {name: owner[id(p)] for name, p in model.named_parameters() if id(p) in owner}


def resolve_run_plans(
    model_config: ModelConfig, parallel: ParallelConfig, config: TrainConfig
) -> list[ParallelPlan]:
    """The plan :func:`train` applies, one per pipeline stage (one without pipelining),
    resolved on a meta-device model without any process group, with each parameter's
    optimizer group from the optimizer the run builds (:func:`hp_train.optim.build_optimizer`
    on the meta model: Muon/AdamW by ``hp_muon.split_params``, or AdamW alone).

    Stage ``k``'s plan is over its ``(dp_replicate, dp_shard, tp)`` ranks of the
    ``(pp, dp_replicate, dp_shard, tp)`` grid and names the modules the stage keeps.

    Raises:
        ConfigError: the model cannot be split ``tp`` ways or into ``pp`` stages.
    """
    check_model_fits(model_config, parallel)
    grid = job_mesh(parallel)
    plans: list[ParallelPlan] = []
    for k in range(parallel.pp):
        with torch.device("meta"):
            model = Transformer(model_config)
        if parallel.pp > 1:
            keep_stage(model, k, stage_boundaries(model_config, parallel.pp))
        groups = optimizer_groups(model, build_optimizer(model, config))
        # The stage's plan with the FSDP slots of its first rank, as hp-fsdp will plan them.
        first = grid.rank_at((k, 0, 0, 0)) if parallel.pp > 1 else 0
        plans.append(
            planned_model(model_config, parallel, rank=first).with_optimizer_groups(groups)
        )
    return plans


def plan_report(model_config: ModelConfig, parallel: ParallelConfig, config: TrainConfig) -> str:
    """What ``--print-plan`` prints: a header line naming the world size and the axes, then
    the plan table of :func:`resolve_run_plans` (local shapes of the first rank), one per
    pipeline stage with a line naming the stage's modules and ranks."""
    plans = resolve_run_plans(model_config, parallel, config)
    axes = f"dp_replicate={parallel.dp_replicate} x dp_shard={parallel.dp_shard} x tp={parallel.tp}"
    kind = "MoE" if model_config.moe else "dense"
    header = (
        f"hp-train plan: world size {parallel.world_size} = "
        + (f"pp={parallel.pp} x {axes}" if parallel.pp > 1 else axes)
        + f"; {kind} model dim {model_config.dim}, {model_config.n_layers} layers; "
        f"optimizer {config.optimizer}"
    )
    if parallel.pp == 1:
        return f"{header}\n\n{plans[0].table(rank=0)}"
    boundaries = stage_boundaries(model_config, parallel.pp)
    parts = [
        f"{header}; one plan per pipeline stage (each over its stage's "
        "dp_replicate x dp_shard x tp ranks, naming the modules the stage keeps)"
    ]
    for k, plan in enumerate(plans):
        first, end = boundaries[k], boundaries[k + 1]
        held = [f"blocks {first}..{end - 1}" if end - first > 1 else f"block {first}"]
        if k == 0:
            held.insert(0, "the embedding")
        if k == parallel.pp - 1:
            held.append("the final norm and the head")
        ranks = plan.mesh.ranks
        parts.append(
            f"=== stage {k} of {parallel.pp}: {', '.join(held)}; ranks {ranks[0]}..{ranks[-1]}"
            f"\n\n{plan.table(rank=ranks[0])}"
        )
    return "\n\n".join(parts)


def _applied_plan(
    model: Transformer, unstyled: ParallelPlan | None, optimizer: torch.optim.Optimizer
) -> ParallelPlan:
    """The plan the run applied (see the module docstring); ``unstyled``: the plan resolved
    before :func:`parallelize` when ``tp == 1`` (no TP plan is applied then)."""
    applied = parallel_plan_of(model)
    if unstyled is None:
        if applied is None:
            raise RuntimeError("parallelize() applied a tensor-parallel plan but none is recorded")
        plan = applied
    else:
        slots = {p.fqn: p.flat for p in applied.params if p.flat} if applied else {}
        plan = unstyled.with_flat_slots(slots)
    return plan.with_optimizer_groups(optimizer_groups(model, optimizer))


def _write_plan(path: Path, plan: ParallelPlan, layout: Layout3D, rank: int) -> None:
    """Rank 0 writes ``plan.json``; with pipelining the first rank of each stage sends its
    stage's plan to rank 0 first (collective)."""
    if layout.pipeline_mesh is None:
        if rank == 0:
            write_json(path, plan.to_dict())
        return
    mine = plan.to_dict() if plan.mesh.ranks[0] == rank else None
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        # pp is the outermost axis: the stages' first ranks come in stage order.
        stages = [entry for entry in gathered if entry is not None]
        write_json(path, {"pp": len(stages), "stages": stages})


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
    # With tp == 1 no TP plan is applied: resolve the (unstyled) plan before FSDP replaces
    # the parameters by their flat pieces.
    unstyled = resolve_tp_plan(model, layout.mesh) if layout.tp_size == 1 else None
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
    plan = _applied_plan(model, unstyled, optimizer)
    _write_plan(options.out_dir / PLAN_FILE, plan, layout, runtime.rank)
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
