"""A rank's training state as raw bytes, and back: what an in-memory snapshot holds.

The state is every tensor a step reads and a later step depends on, in the layout training
keeps it (no redistribution, so no collective): this rank's local pieces of the model's
parameters and buffers, its optimizer's per-parameter state tensors, and the RNG states of the
CPU and of the device. Non-tensor optimizer state (Python numbers) goes into the header's
extras. A disk checkpoint holds the same model and optimizer state in a layout-free form
(:mod:`hp_train.checkpoint.dcp`); a snapshot restores only into the same layout and world
size, bit for bit.

:func:`state_entries` lists the tensors in a fixed order with their offsets in the payload
(each 64-byte aligned); :func:`capture` copies them into a caller's buffer, which is reused
step after step; :func:`restore` copies a payload back in place, after checking that every
name, dtype and shape is the one this process has.

Postconditions (tested): ``restore(capture(s))`` leaves parameters, optimizer state and RNG
states bitwise equal to ``s``; a payload of another structure raises
:class:`SnapshotMismatchError` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_fsdp import init_optimizer_state
from hp_train.parallel.rng import rng_states, set_rng_states
from hp_train.recovery.snapshot_file import Entry

__all__ = [
    "SnapshotMismatchError",
    "TrainingState",
    "capture",
    "optimizer_scalars",
    "restore",
    "state_entries",
]

_ALIGN = 64
# The prefix of the random generators' entries (``rng/cpu``, ``rng/cuda``).
_RNG = "rng/"


class SnapshotMismatchError(ValueError):
    """A snapshot of another model, optimizer or layout than this process's (the message
    names the first tensor that differs)."""


@dataclass(frozen=True)
class TrainingState:
    """Where a rank's state lives: the model, the optimizer (the wrapped one, whose state
    tensors are the optimizer's own), the device (for its RNG)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def _tensors(state: TrainingState) -> Iterator[tuple[str, torch.Tensor]]:
    """Every state tensor of the rank with its name, in a fixed order."""
    for name, p in state.model.named_parameters():
        yield f"param/{name}", _local(p.detach())
    for name, b in state.model.named_buffers():
        yield f"buffer/{name}", _local(b)
    for g, group in enumerate(state.optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in sorted(state.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    yield f"optim/{g}/{i}/{key}", _local(value)
    for device_type, generator in rng_states(state.device).items():
        yield f"{_RNG}{device_type}", generator


def optimizer_scalars(optimizer: torch.optim.Optimizer) -> list[list[Any]]:
    """The optimizer's non-tensor per-parameter state as ``[group, index, key, value]``
    rows (JSON)."""
    rows: list[list[Any]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if not isinstance(value, torch.Tensor):
                    rows.append([g, i, key, value])
    return rows


def state_entries(state: TrainingState) -> tuple[Entry, ...]:
    """The payload layout of ``state``: each tensor's name, dtype, shape, offset, bytes."""
    entries = []
    offset = 0
    for name, t in _tensors(state):
        nbytes = t.numel() * t.element_size()
        entries.append(
            Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes)
        )
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(entries)


def payload_size(entries: Sequence[Entry]) -> int:
    """The bytes a payload of ``entries`` takes."""
    return max((e.offset + e.nbytes for e in entries), default=0)


def capture(state: TrainingState, entries: Sequence[Entry], buffer: torch.Tensor) -> None:
    """Copy ``state``'s tensors into ``buffer`` (a CPU ``uint8`` tensor of at least
    :func:`payload_size` bytes) at ``entries``' offsets.

    Raises:
        SnapshotMismatchError: ``state`` no longer has the structure ``entries`` describes
            (the optimizer created state since: take :func:`state_entries` again).
    """
    current = list(_tensors(state))
    if len(current) != len(entries):
        raise SnapshotMismatchError(
            f"the state has {len(current)} tensors and the snapshot layout {len(entries)}: take "
            "state_entries again"
        )
    with torch.no_grad():
        for entry, (name, t) in zip(entries, current, strict=True):
            _check(entry, name, t)
            piece = buffer[entry.offset : entry.offset + entry.nbytes]
            piece.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


def _check(entry: Entry, name: str, t: torch.Tensor) -> None:
    dtype = str(t.dtype).removeprefix("torch.")
    if (entry.name, entry.dtype, entry.shape) != (name, dtype, tuple(t.shape)):
        raise SnapshotMismatchError(
            f"snapshot tensor {entry.name} ({entry.dtype}, {list(entry.shape)}) where this "
            f"process has {name} ({dtype}, {list(t.shape)}): the snapshot is of another model, "
            "optimizer or layout"
        )


def restore(
    state: TrainingState,
    entries: Sequence[Entry],
    payload: torch.Tensor,
    scalars: Sequence[Sequence[Any]],
) -> None:
    """Copy a payload (a CPU ``uint8`` tensor) back into ``state`` in place, and the
    optimizer's non-tensor state from ``scalars`` (collective when the optimizer has no state
    yet: it is created first with a zero step, as a checkpoint load does).

    Raises:
        SnapshotMismatchError: the payload's structure is not this process's (nothing is
            changed then).
    """
    init_optimizer_state(state.optimizer)
    current = list(_tensors(state))
    if len(current) != len(entries):
        raise SnapshotMismatchError(
            f"the snapshot holds {len(entries)} tensors and this process has {len(current)}: "
            "the snapshot is of another model, optimizer or layout"
        )
    for entry, (name, t) in zip(entries, current, strict=True):
        _check(entry, name, t)
    generators: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for entry, (name, t) in zip(entries, current, strict=True):
            raw = payload[entry.offset : entry.offset + entry.nbytes]
            value = raw.view(getattr(torch, entry.dtype)).view(entry.shape)
            if name.startswith(_RNG):
                generators[name.removeprefix(_RNG)] = value.clone()
            else:
                t.copy_(value)
    set_rng_states(generators, state.device)
    params = [group["params"] for group in state.optimizer.param_groups]
    for g, i, key, value in scalars:
        state.optimizer.state[params[g][i]][key] = value
