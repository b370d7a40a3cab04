"""Checkpoints with ``torch.distributed.checkpoint``, never half-written when taken as latest.

A checkpoint of step ``n`` is written into ``<root>/step_<n>.partial/`` by every rank; after
all ranks finished (a barrier), rank 0 renames it to ``<root>/step_<n>/``. A rename is atomic,
so a directory without the ``.partial`` suffix is complete: a job killed while saving leaves
only a ``.partial`` directory, which :func:`latest_checkpoint` ignores and the next save of
the same step replaces. The model and optimizer state dicts are those of hp-fsdp (torch
DTensors), so a checkpoint loads at another world size or layout.

Under pipeline parallelism each stage's ranks hold a different optimizer (other parameters
in its groups), so its parameter groups are saved under ``optim_groups.stage_<s>_of_<pp>``
instead of ``optim.param_groups``; tensors keep their model-wide names. Such a checkpoint
resumes with the same number of stages (any data and tensor-parallel sizes).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hp_fsdp import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = [
    "PARTIAL_SUFFIX",
    "CheckpointMismatchError",
    "StageOf",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d+)$")
_STAGE_GROUPS = re.compile(r"^optim_groups\.stage_\d+_of_(\d+)\.")


class CheckpointMismatchError(ValueError):
    """A checkpoint saved with a pipeline layout this run cannot take."""


@dataclass(frozen=True)
class StageOf:
    """This rank's pipeline stage: ``stage`` of ``stages``."""

    stage: int
    stages: int

    @property
    def key(self) -> str:
        """The state-dict key of this stage's optimizer parameter groups."""
        return f"stage_{self.stage}_of_{self.stages}"


def _saved_stages(path: Path) -> int:
    """The number of pipeline stages a checkpoint was saved with (1: not pipelined)."""
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key in keys:
        match = _STAGE_GROUPS.match(key)
        if match:
            return int(match.group(1))
    return 1


def _state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, stage: StageOf | None
) -> dict[str, Any]:
    optim = get_optimizer_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optim": optim,
        "progress": {"step": torch.tensor(step)},
    }
    if stage is not None:
        state["optim_groups"] = {stage.key: optim.pop("param_groups")}
    return state


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    base = Path(root)
    if not base.is_dir():
        return None
    found = []
    for entry in base.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and (entry / ".metadata").is_file():
            found.append((int(match.group(1)), entry))
    return max(found) if found else None


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: StageOf | None = None,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Save the state after ``step`` steps (collective; every rank calls it; ``stage`` under
    pipeline parallelism). ``files``: text files (name to content, the same on every rank)
    that rank 0 writes into the checkpoint beside the tensors before it is complete, such as
    the data loader's position and the run's configuration."""
    final = _step_dir(Path(root), step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    dcp_save(_state(model, optimizer, step, stage), checkpoint_id=str(partial))
    if dist.get_rank() == 0:
        for name, text in (files or {}).items():
            (partial / name).write_text(text)
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    return final


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: StageOf | None = None,
) -> int:
    """Load a checkpoint into ``model`` and ``optimizer`` in place; returns its step
    (collective).

    Raises:
        CheckpointMismatchError: the checkpoint was saved with another number of pipeline stages.
    """
    saved = _saved_stages(Path(path))
    wanted = 1 if stage is None else stage.stages
    if saved != wanted:
        raise CheckpointMismatchError(
            f"{path} was saved with pp={saved} pipeline stages and this run has pp={wanted}: "
            f"resume with --pp {saved} (the data and tensor-parallel sizes may change)"
        )
    state = _state(model, optimizer, 0, stage)
    dcp_load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    optim_sd = state["optim"]
    if stage is not None:
        optim_sd["param_groups"] = state["optim_groups"][stage.key]
    set_optimizer_state_dict(model, optimizer, optim_sd)
    return int(state["progress"]["step"])
