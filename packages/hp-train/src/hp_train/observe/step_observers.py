"""The observers a run attaches to chosen steps, as one object the step loop calls.

:class:`StepObservers` holds what the options ask for: the profiler of ``--profile``
(:class:`~hp_train.observe.profiling.StepProfiler`), the memory measurement of
``--memory-snapshot`` (:class:`~hp_train.observe.memory_snapshot.MemorySnapshot`) and the
offline Weights & Biases run of ``--wandb`` (:class:`~hp_train.observe.wandb_log.WandbLog`,
rank 0 only). The loop calls :meth:`~StepObservers.begin` just before a step's forward,
:meth:`~StepObservers.end` right after its optimizer step (before evaluation and checkpoints,
which are not the step's cost), :meth:`~StepObservers.scalars` beside TensorBoard's, and
:meth:`~StepObservers.close` once. Steps are 1-based, as the step lines and ``metrics.jsonl``
count them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hp_train.observe.memory_snapshot import MemorySnapshot, format_memory
from hp_train.observe.profiling import StepProfiler
from hp_train.observe.wandb_log import WandbLog, open_wandb

__all__ = ["StepObservers", "open_step_observers"]


@dataclass
class StepObservers:
    """The run's per-step observers; each is None when not asked for."""

    profiler: StepProfiler | None = None
    memory: MemorySnapshot | None = None
    tracker: WandbLog | None = None

    def begin(self, step: int) -> None:
        """Start observing ``step`` (1-based) where it is one of the chosen steps. The memory
        measurement starts inside the profiler's window, so a profiled step shows its
        overhead rather than hiding it."""
        if self.profiler is not None:
            self.profiler.step_begin(step)
        if self.memory is not None:
            self.memory.step_begin(step)

    def end(self, step: int) -> list[str]:
        """Stop observing ``step``; the lines for the log (the memory figures, the profile's
        top operators), none for a step not chosen."""
        lines: list[str] = []
        if self.memory is not None and (figures := self.memory.step_end(step)):
            lines.append(f"step {step}: {format_memory(figures)}")
        if self.profiler is not None and (table := self.profiler.step_end(step)):
            lines.append(table)  # titled with its step, rank and trace file
        return lines

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Log the step's scalars to the tracker (TensorBoard's tags), if there is one."""
        if self.tracker is not None:
            self.tracker.scalars(step, values)

    def close(self) -> None:
        """Close every observer (each at most once); the first error is raised after all are
        closed."""
        first: BaseException | None = None
        for observer in (self.profiler, self.memory, self.tracker):
            if observer is None:
                continue
            try:
                observer.close()
            except BaseException as exc:
                first = first or exc
        self.profiler = self.memory = self.tracker = None
        if first is not None:
            raise first


def open_step_observers(
    out_dir: Path,
    *,
    rank: int,
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    profile_steps: Sequence[int],
    memory_steps: Sequence[int],
    wandb_project: str | None,
    wandb_config: Mapping[str, object],
    resume_step: int | None,
) -> StepObservers:
    """The observers of a run in ``out_dir`` on ``rank``: a profiler when ``profile_steps``,
    a memory measurement when ``memory_steps``, a W&B run on rank 0 when ``wandb_project``
    (None: no W&B), resumed into the same W&B run when ``resume_step``."""
    return StepObservers(
        profiler=StepProfiler(out_dir, rank, profile_steps, device) if profile_steps else None,
        memory=(
            MemorySnapshot(out_dir, rank, memory_steps, device, model, optimizer)
            if memory_steps
            else None
        ),
        tracker=(
            open_wandb(
                out_dir,
                project=wandb_project,
                run_name=out_dir.name,
                config=wandb_config,
                resume_step=resume_step,
            )
            if wandb_project is not None and rank == 0
            else None
        ),
    )
