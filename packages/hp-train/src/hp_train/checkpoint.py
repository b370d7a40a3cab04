"""Checkpoints with ``torch.distributed.checkpoint``, never half-written when taken as latest.

A checkpoint of step ``n`` is written into ``<root>/step_<n>.partial/`` by every rank; after
all ranks finished (a barrier), rank 0 renames it to ``<root>/step_<n>/``. A rename is atomic,
so a directory without the ``.partial`` suffix is complete: a job killed while saving leaves
only a ``.partial`` directory, which :func:`latest_checkpoint` ignores and the next save of
the same step replaces. The model and optimizer state dicts are those of hp-fsdp (torch
DTensors), so a checkpoint loads at another world size or layout.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hp_fsdp import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = ["PARTIAL_SUFFIX", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d+)$")


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
    root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Path:
    """Save the state after ``step`` steps (collective; every rank calls it)."""
    final = _step_dir(Path(root), step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = {
        "model": model.state_dict(),
        "optim": get_optimizer_state_dict(model, optimizer),
        "progress": {"step": torch.tensor(step)},
    }
    dcp_save(state, checkpoint_id=str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load a checkpoint into ``model`` and ``optimizer`` in place; returns its step
    (collective)."""
    model_sd = model.state_dict()
    optim_sd = get_optimizer_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "progress": {"step": torch.tensor(0)},
    }
    dcp_load(state, checkpoint_id=str(path))
    model.load_state_dict(model_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd)
    return int(state["progress"]["step"])
