"""One rank's in-memory snapshot as files in its host's snapshot folder: a payload of raw
tensor bytes and a JSON header, written so that a reader never takes a half-written one.

Layout of a host's folder (``--snapshot-dir``, by default under ``/dev/shm``, which is memory
and outlives the worker processes but not the host)::

    <folder>/own/rank_<r>/step_<n>.snap + step_<n>.json      rank r's own snapshots
    <folder>/replica/rank_<r>/step_<n>.snap + step_<n>.json  replicas of rank r's, received

A snapshot is complete when its header (``.json``) exists: both files are written under
temporary names, then the payload is renamed into place and the header last (renames are
atomic), so a process killed while writing leaves only ``*.tmp`` files, which no listing
returns and the next write of the same step replaces. The header holds the payload's size and
SHA-256 (:func:`read_snapshot` checks both), the run it belongs to (``run_id``), the world size
and the tensors' names, dtypes, shapes and offsets (:class:`Entry`).

Postconditions (tested): :func:`read_snapshot` of what :func:`write_snapshot` wrote returns
the same header and bytes; a payload whose size or SHA-256 differs from its header, or a header
that does not parse, raises :class:`SnapshotCorruptError` naming the file; :func:`prune` keeps
the ``keep`` newest complete snapshots of a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hp_train.recovery.plan import Holding, HoldingKind

__all__ = [
    "FORMAT",
    "Entry",
    "SnapshotCorruptError",
    "SnapshotHeader",
    "list_holdings",
    "prune",
    "read_snapshot",
    "snapshot_folder",
    "write_snapshot",
]

#: The header's format tag; a header of another format is not listed.
FORMAT = "hp_train.snapshot.v1"
_NAME = re.compile(r"^step_(\d+)\.json$")
_KIND_FOLDERS: dict[HoldingKind, str] = {"own": "own", "replica": "replica"}


class SnapshotCorruptError(RuntimeError):
    """A snapshot whose files do not match its header (the message names the file)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a payload: ``nbytes`` bytes at ``offset``, of ``dtype`` (torch's name,
    ``float32``) and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SnapshotHeader:
    """What a payload holds and whose state it is.

    Attributes:
        run_id: the run (a new run gets a new one; its restarts keep it).
        owner: the rank whose state it is.
        world: the job's world size when it was taken.
        step: steps done.
        entries: the tensors, in payload order.
        extras: JSON state besides tensors (the data position, the skipped steps, the run's
            record, the Python RNG).
        size: payload bytes.
        sha256: the payload's SHA-256 (hex).
    """

    run_id: str
    owner: int
    world: int
    step: int
    entries: tuple[Entry, ...]
    extras: Mapping[str, Any] = field(default_factory=dict)
    size: int = 0
    sha256: str = ""

    def to_json(self) -> str:
        """The header as written (the inverse of :meth:`from_json`)."""
        body = {
            "format": FORMAT,
            "run_id": self.run_id,
            "owner": self.owner,
            "world": self.world,
            "step": self.step,
            "size": self.size,
            "sha256": self.sha256,
            "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries],
            "extras": dict(self.extras),
        }
        return json.dumps(body)

    @staticmethod
    def from_json(text: str) -> SnapshotHeader:
        """Parse a header.

        Raises:
            ValueError: not a header of :data:`FORMAT` (the message says what is wrong).
        """
        body = json.loads(text)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"not a snapshot header of format {FORMAT}")
        entries = tuple(
            Entry(str(n), str(d), tuple(int(x) for x in s), int(o), int(b))
            for n, d, s, o, b in body["entries"]
        )
        return SnapshotHeader(
            run_id=str(body["run_id"]),
            owner=int(body["owner"]),
            world=int(body["world"]),
            step=int(body["step"]),
            entries=entries,
            extras=dict(body["extras"]),
            size=int(body["size"]),
            sha256=str(body["sha256"]),
        )


def snapshot_folder(root: Path, kind: HoldingKind, owner: int) -> Path:
    """The folder of ``owner``'s snapshots of ``kind`` in a host's snapshot folder ``root``."""
    return root / _KIND_FOLDERS[kind] / f"rank_{owner}"


def _paths(folder: Path, step: int) -> tuple[Path, Path]:
    stem = f"step_{step:08d}"
    return folder / f"{stem}.snap", folder / f"{stem}.json"


def write_snapshot(folder: Path, header: SnapshotHeader, payload: memoryview | bytes) -> Path:
    """Write ``payload`` and ``header`` (its ``size`` and ``sha256`` filled in here) into
    ``folder`` atomically (module docstring); returns the header's path."""
    digest = hashlib.sha256(payload).hexdigest()
    complete = SnapshotHeader(
        header.run_id,
        header.owner,
        header.world,
        header.step,
        header.entries,
        header.extras,
        size=len(payload),
        sha256=digest,
    )
    return write_verified(folder, complete, payload)


def write_verified(folder: Path, header: SnapshotHeader, payload: memoryview | bytes) -> Path:
    """Write a snapshot whose header already holds the payload's size and SHA-256 (a replica
    as received: the receiver has checked it) atomically; returns the header's path."""
    folder.mkdir(parents=True, exist_ok=True)
    data, head = _paths(folder, header.step)
    data_tmp, head_tmp = data.with_suffix(".snap.tmp"), head.with_suffix(".json.tmp")
    with data_tmp.open("wb") as f:
        f.write(payload)
    head_tmp.write_text(header.to_json())
    os.replace(data_tmp, data)
    os.replace(head_tmp, head)
    return head


def read_header(path: Path) -> SnapshotHeader:
    """The header at ``path`` (a ``step_<n>.json``).

    Raises:
        SnapshotCorruptError: it cannot be read or parsed.
    """
    try:
        return SnapshotHeader.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotCorruptError(
            f"{path}: unreadable header ({type(exc).__name__}: {exc})"
        ) from exc


def read_snapshot(path: Path) -> tuple[SnapshotHeader, bytearray]:
    """The header at ``path`` and its payload, checked against the header's size and SHA-256.

    Raises:
        SnapshotCorruptError: the header does not parse, or the payload is missing, of another
            size, or of another SHA-256 (the message names the file).
    """
    header = read_header(path)
    data = path.with_suffix(".snap")
    try:
        payload = bytearray(data.read_bytes())
    except OSError as exc:
        raise SnapshotCorruptError(f"{data}: unreadable ({type(exc).__name__}: {exc})") from exc
    check_payload(header, payload, str(data))
    return header, payload


def check_payload(
    header: SnapshotHeader, payload: memoryview | bytes | bytearray, where: str
) -> None:
    """Raise :class:`SnapshotCorruptError` naming ``where`` unless ``payload`` has the header's
    size and SHA-256."""
    if len(payload) != header.size:
        raise SnapshotCorruptError(f"{where}: {len(payload)} bytes, its header says {header.size}")
    if hashlib.sha256(payload).hexdigest() != header.sha256:
        raise SnapshotCorruptError(f"{where}: SHA-256 differs from its header's (same size)")


def _complete(folder: Path) -> list[tuple[int, Path]]:
    """The complete snapshots (their header paths) of one folder, newest first."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def prune(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete snapshots of ``folder`` and every leftover
    temporary file (called by the folder's one writer after a write completed, so a ``.tmp``
    file is what a killed writer left)."""
    for _, head in _complete(folder)[keep:]:
        head.unlink(missing_ok=True)
        head.with_suffix(".snap").unlink(missing_ok=True)
    for leftover in folder.glob("step_*.tmp"):
        leftover.unlink(missing_ok=True)


@dataclass(frozen=True)
class Listed:
    """A snapshot found in a host's folder: the :class:`Holding` it is and its header's path."""

    holding: Holding
    header: Path


def list_holdings(root: Path, host: str, run_id: str, world: int) -> list[Listed]:
    """The complete snapshots of run ``run_id`` at world size ``world`` in the host folder
    ``root`` (headers read, payloads not checked); headers that do not parse, or of another
    run or world size, are left out."""
    found: list[Listed] = []
    for kind, name in _KIND_FOLDERS.items():
        base = root / name
        if not base.is_dir():
            continue
        for folder in sorted(base.iterdir()):
            for step, head in _complete(folder):
                try:
                    header = read_header(head)
                except SnapshotCorruptError:
                    continue
                if header.run_id != run_id or header.world != world or header.step != step:
                    continue
                found.append(Listed(Holding(header.owner, step, host, kind), head))
    return found


def remove_other_runs(root: Path, run_id: str, owners: Sequence[int]) -> None:
    """Delete the snapshots of ``owners`` in ``root`` that belong to another run (a new run
    in the same output folder starts with none of the old one's)."""
    for kind in _KIND_FOLDERS:
        for owner in owners:
            for _, head in _complete(snapshot_folder(root, kind, owner)):
                try:
                    stale = read_header(head).run_id != run_id
                except SnapshotCorruptError:
                    stale = True
                if stale:
                    head.unlink(missing_ok=True)
                    head.with_suffix(".snap").unlink(missing_ok=True)
