"""Checkpoints with ``torch.distributed.checkpoint``, never half-written when taken as latest.

A checkpoint of step ``n`` is written into ``<root>/step_<n>.partial/`` by every rank; after
all ranks finished (a barrier), rank 0 renames it to ``<root>/step_<n>/``. A rename is atomic,
so a directory without the ``.partial`` suffix is complete: a job killed while saving leaves
only a ``.partial`` directory, which :func:`latest_checkpoint` ignores and the next save of
the same step replaces. The model and optimizer state dicts are those of hp-fsdp (torch
DTensors), so a checkpoint loads at another world size or layout.

Every rank's random generators (the CPU's and its device's: dropout draws from them) are saved
under ``rng.rank_<r>``; a load at the same world size restores each rank's own, so a resumed
run draws the same dropout masks as an uninterrupted one. At another world size they are not
restored (the ranks' streams are another set) and the load says so.

Under pipeline parallelism each stage's ranks hold a different optimizer (other parameters
in its groups), so its parameter groups are saved under ``optim_groups.stage_<s>_of_<pp>``
instead of ``optim.param_groups``; tensors keep their model-wide names. Such a checkpoint
resumes with the same number of stages (any data and tensor-parallel sizes).

Integrity: once every rank has written its files (and rank 0 the text files), the ranks hash
them (each a share, SHA-256) and rank 0 writes ``manifest.json`` (every file's size and
SHA-256) into the ``.partial`` directory before the rename; a complete checkpoint therefore
always has one. :func:`verify_checkpoint` checks a checkpoint against it before a load (each
rank a share of the files, then one gather so that every rank reaches the same verdict): a
missing file, another size (truncated, or appended to), another SHA-256 (bytes overwritten in
place) or an empty ``.metadata`` is a problem that names the file.

Deleting the manifest does not switch the check off. Every checkpoint this version writes
also holds a format marker in its DCP state dict (:data:`FORMAT_KEY`, listed in ``.metadata``,
which the manifest covers but does not hold): a checkpoint with the marker and no manifest is
refused. One without either was written before manifests existed, or lost its manifest and
was written before the marker; it is refused too unless the user marked it as old
(:func:`mark_legacy`, ``python -m hp_train.checkpoint mark-legacy DIR``: a file
:data:`LEGACY_MARK` in it, refused for a checkpoint with the marker). A marked one is accepted
unverified, after a structural check (its ``.metadata`` reads and every file it points into
exists and is long enough), and the caller says so.

A load that fails on data torch cannot read (a checkpoint that verified, or a marked old one,
whose bytes changed after the check) raises :class:`CheckpointLoadError` on every rank alike:
the ranks agree in one gather, since the failure may come on one rank only. A save that fails
on any rank (a full disk) raises :class:`CheckpointWriteError` on every rank and leaves only
the ``.partial`` directory: the latest complete checkpoint stays what it was.

Every collective here runs inside :func:`hp_dtensor.watchdog.watch` under a name that says
which checkpoint step it is (``checkpoint verify gather``, ...), so that a rank that never
joins one makes the others raise ``CollectiveTimeoutError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from hp_dtensor.watchdog import watch
from hp_fsdp import get_optimizer_state_dict, set_optimizer_state_dict
from hp_train.objects import from_rank_0, gather_objects
from hp_train.parallel.rng import rng_states, set_rng_states

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "LEGACY_MARK",
    "MANIFEST_FILE",
    "PARTIAL_SUFFIX",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointListing",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "StageOf",
    "Verification",
    "checkpoints_newest_first",
    "has_format_marker",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "mark_legacy",
    "save_checkpoint",
    "verify_checkpoint",
    "write_manifest",
]

PARTIAL_SUFFIX = ".partial"
#: Every file of a checkpoint with its size and SHA-256, written last (before the rename).
MANIFEST_FILE = "manifest.json"
_MANIFEST_VERSION = 1
#: The entry of the DCP state dict that every checkpoint of this version holds (its value is
#: :data:`FORMAT_VERSION`): ``.metadata`` lists it, so a checkpoint whose manifest is gone is
#: still known to have had one.
FORMAT_KEY = "hp_train_format"
#: The checkpoint format this version writes: 2, checkpoints with a manifest (1, implicit:
#: those before, without marker or manifest).
FORMAT_VERSION = 2
#: The file that marks a checkpoint without a manifest as written before manifests existed
#: (:func:`mark_legacy`); only such a checkpoint loads unverified.
LEGACY_MARK = "legacy_format"
_METADATA = ".metadata"
_NAME = re.compile(r"^step_(\d+)$")
_STAGE_GROUPS = re.compile(r"^optim_groups\.stage_\d+_of_(\d+)\.")
_RNG = "rng"
_LOG = logging.getLogger("hp_train.checkpoint")


class CheckpointMismatchError(ValueError):
    """A checkpoint saved with a pipeline layout this run cannot take."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written (raised on every rank alike)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files do not match its manifest (or, for ``--resume``, no
    checkpoint that verifies); the message names each checkpoint and file."""


class CheckpointLoadError(CheckpointCorruptError):
    """torch could not read a checkpoint's data (every rank raises it alike).

    Attributes:
        path: the checkpoint.
        causes: each failing rank's error (``rank 1: UnpicklingError: ...``).
    """

    def __init__(self, path: Path, causes: str) -> None:
        super().__init__(f"could not load checkpoint {path} ({causes})")
        self.path = path
        self.causes = causes

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (rank pools send exceptions between processes).
        return (CheckpointLoadError, (self.path, self.causes))


class CheckpointWriteError(CheckpointError):
    """A save failed on some rank (a full disk, a permission); the half-written checkpoint is
    left as ``.partial`` and the previous complete ones are untouched."""


@dataclass(frozen=True)
class Verification:
    """What :func:`verify_checkpoint` found.

    Attributes:
        path: the checkpoint.
        problems: what is wrong, each naming the file (``__1_0.distcp: missing``); empty when
            the checkpoint can be loaded.
        verified: a manifest was there and every file matched it (False for a checkpoint
            written before manifests existed, accepted after a structural check only).
    """

    path: Path
    problems: tuple[str, ...]
    verified: bool

    @property
    def ok(self) -> bool:
        """Whether the checkpoint can be loaded."""
        return not self.problems

    def describe(self) -> str:
        """``<path>: <problem>; <problem>``."""
        return f"{self.path}: {'; '.join(self.problems) or 'ok'}"


@dataclass(frozen=True)
class StageOf:
    """This rank's pipeline stage: ``stage`` of ``stages``."""

    stage: int
    stages: int

    @property
    def key(self) -> str:
        """The state-dict key of this stage's optimizer parameter groups."""
        return f"stage_{self.stage}_of_{self.stages}"


def _saved_layout(path: Path) -> tuple[int, set[str]]:
    """The number of pipeline stages a checkpoint was saved with (1: not pipelined) and the
    random-generator entries it holds (``rng.rank_<r>.<device>``), as rank 0 reads its
    ``.metadata`` (collective, so that a rank that cannot read it does not leave the others in
    torch's load).

    Raises:
        CheckpointLoadError: rank 0 could not read ``.metadata`` (on every rank).
    """

    def read() -> tuple[int, set[str]] | str:
        try:
            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as exc:  # anything torch raises on a damaged file
            return f"rank 0: {_METADATA} unreadable ({type(exc).__name__}: {exc})"
        stages = 1
        for key in keys:
            match = _STAGE_GROUPS.match(key)
            if match:
                stages = int(match.group(1))
        return stages, {key for key in keys if key.startswith(_RNG + ".")}

    found = from_rank_0("checkpoint load metadata broadcast", read)
    if isinstance(found, str):
        raise CheckpointLoadError(path, found)
    return found


def _param_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


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


def has_format_marker(metadata: Metadata) -> bool:
    """Whether a checkpoint's ``.metadata`` lists :data:`FORMAT_KEY` (written by an hp-train
    that writes manifests)."""
    prefix = FORMAT_KEY + "."
    return any(key == FORMAT_KEY or key.startswith(prefix) for key in metadata.state_dict_metadata)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def checkpoints_newest_first(root: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint directory ``step_<n>`` under ``root`` (not the ``.partial`` ones),
    the highest step first, complete or not: what ``--resume`` tries in turn
    (:func:`verify_checkpoint` says which can be loaded)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


@dataclass(frozen=True)
class CheckpointListing:
    """The checkpoints of a folder, as :func:`list_checkpoints` found them.

    Attributes:
        checkpoints: the ``step_<n>`` directories, the highest step first (complete or not:
            :func:`verify_checkpoint` says which can be loaded).
        partial: the ``step_<n>.partial`` directories (saves that never finished, never
            loaded), the highest step first.
    """

    checkpoints: tuple[Path, ...]
    partial: tuple[Path, ...]


def list_checkpoints(root: str | Path) -> CheckpointListing:
    """The checkpoints under ``root`` as rank 0 sees them, the same on every rank
    (collective: one broadcast, so that every rank tries the same ones in the same order)."""
    base = Path(root)

    def listing() -> CheckpointListing:
        partial: list[tuple[int, Path]] = []
        if base.is_dir():
            for entry in base.iterdir():
                match = _NAME.match(entry.name.removesuffix(PARTIAL_SUFFIX))
                if entry.name.endswith(PARTIAL_SUFFIX) and match and entry.is_dir():
                    partial.append((int(match.group(1)), entry))
        return CheckpointListing(
            tuple(path for _, path in checkpoints_newest_first(base)),
            tuple(path for _, path in sorted(partial, reverse=True)),
        )

    return from_rank_0("checkpoint list broadcast", listing)


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
    the data loader's position and the run's configuration. The state dict holds the format
    marker (:data:`FORMAT_KEY`) beside the model, optimizer and step."""
    final = _step_dir(Path(root), step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)

    def start() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def write_files() -> None:
        for name, text in (files or {}).items():
            (partial / name).write_text(text)

    def complete() -> None:
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)

    # Each step on rank 0 tells every rank how it went (the others wait for it), so that a
    # failure there raises everywhere instead of leaving the others in a barrier.
    _on_rank_0(start, partial, "checkpoint save start broadcast")
    state = _state(model, optimizer, step, stage)
    state[FORMAT_KEY] = {"version": FORMAT_VERSION}
    state[_RNG] = {f"rank_{dist.get_rank()}": rng_states(_param_device(model))}
    try:
        with watch("checkpoint save (torch DCP)"):
            dcp_save(state, checkpoint_id=str(partial))
    except CheckpointException as exc:
        raise CheckpointWriteError(_write_failure(partial, exc)) from exc
    _on_rank_0(write_files, partial, "checkpoint save text files broadcast")
    write_manifest(partial)
    _on_rank_0(complete, partial, "checkpoint save rename broadcast")
    return final


def _write_failure(partial: Path, exc: CheckpointException) -> str:
    return (
        f"could not write checkpoint {partial} ({_causes(exc)}); it stays incomplete (.partial, "
        "never taken by --resume) and the earlier checkpoints are untouched"
    )


def _causes(exc: CheckpointException) -> str:
    return "; ".join(
        f"rank {rank}: {_cause(failure)}" for rank, failure in sorted(exc.failures.items())
    )


def _cause(failure: object) -> str:
    error = failure[0] if isinstance(failure, tuple) and failure else failure
    return f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)


def _on_rank_0(work: Callable[[], None], partial: Path, name: str) -> None:
    """``work()`` on rank 0, its failure (OSError) raised on every rank (collective, watched
    as ``name``)."""

    def attempt() -> str | None:
        try:
            work()
        except OSError as exc:
            return f"rank 0: {type(exc).__name__}: {exc}"
        return None

    failure = from_rank_0(name, attempt)
    if failure is not None:
        raise CheckpointWriteError(
            f"could not write checkpoint {partial} ({failure}); it stays incomplete "
            "(.partial, never taken by --resume) and the earlier checkpoints are untouched"
        )


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _names_from_rank_0(folder: Path) -> list[str]:
    """The files of ``folder`` as rank 0 lists them (broadcast: every rank the same list)."""

    def names() -> list[str]:
        return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)

    return from_rank_0("checkpoint manifest file list broadcast", names)


def write_manifest(folder: str | Path) -> None:
    """Hash every file of the checkpoint being written in ``folder`` (each rank a share)
    and have rank 0 write :data:`MANIFEST_FILE` (collective; after every rank has written
    its files). Its last broadcast is the barrier before the rename: no rank goes on before
    the manifest is written.

    Raises:
        CheckpointWriteError: a file could not be read or the manifest written (every rank).
    """
    base = Path(folder)
    names = _names_from_rank_0(base)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: dict[str, object] = {}
    try:
        for name in names[rank::world]:
            path = base / name
            mine[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    except OSError as exc:
        mine = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}
    entries: dict[str, object] = {}
    for part in gather_objects(mine, "checkpoint manifest hash gather"):
        assert isinstance(part, dict)
        if "error" in part:
            raise CheckpointWriteError(f"could not hash checkpoint {base} ({part['error']})")
        entries.update(part)

    def write() -> None:
        manifest = {
            "version": _MANIFEST_VERSION,
            "hash": "sha256",
            "files": {name: entries[name] for name in names},
        }
        (base / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")

    _on_rank_0(write, base, "checkpoint manifest write broadcast")


def _read_manifest(path: Path) -> tuple[dict[str, dict[str, Any]] | None, list[str]]:
    """The manifest's files (None: there is no manifest) and any problem reading it."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        return None, []
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        if manifest.get("version") != _MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError(f"version {manifest.get('version')!r}")
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {}, [f"{MANIFEST_FILE}: unreadable ({type(exc).__name__}: {exc})"]
    return files, []


def _read_metadata(path: Path) -> Metadata | str:
    """A checkpoint's ``.metadata``, or the problem reading it."""
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # anything torch raises on a damaged file
        return f"{_METADATA}: unreadable ({type(exc).__name__}: {exc})"


def _unmanifested_problems(path: Path) -> list[str]:
    """A checkpoint without a manifest: refused when it has the format marker (its manifest
    was deleted) or is not marked as old (:func:`mark_legacy`); a marked one must pass the
    structural check (:func:`_structure_problems`)."""
    metadata = _read_metadata(path)
    if isinstance(metadata, str):
        return [metadata]
    if has_format_marker(metadata):
        return [
            f"{MANIFEST_FILE}: missing, though hp-train wrote this checkpoint with one (its "
            f"{_METADATA} holds the format marker {FORMAT_KEY}): its files cannot be verified"
        ]
    if not (path / LEGACY_MARK).is_file():
        return [
            f"{MANIFEST_FILE}: missing, and the checkpoint is not marked as written before "
            "hp-train checksummed its checkpoints; if it is that old, mark it with: python -m "
            f"hp_train.checkpoint mark-legacy {path}"
        ]
    return _structure_problems(path, metadata)


def _structure_problems(path: Path, metadata: Metadata) -> list[str]:
    """A checkpoint without a manifest: every file its ``.metadata`` points into exists and
    holds the bytes it points at."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif file.stat().st_size < end:
            problems.append(
                f"{name}: {file.stat().st_size} bytes, {_METADATA} points up to byte {end} "
                "(truncated)"
            )
    return problems


def _plan(path: Path) -> dict[str, Any]:
    """Rank 0's part of a verification: whether the checkpoint is there, its manifest."""
    if not path.is_dir():
        return {"problems": ["no such checkpoint directory"], "files": None}
    metadata = path / _METADATA
    if not metadata.is_file():
        return {"problems": [f"{_METADATA}: missing"], "files": None}
    files, problems = _read_manifest(path)
    if metadata.stat().st_size == 0:
        problems.insert(0, f"empty {_METADATA} (0 bytes)")
    if problems:
        return {"problems": problems, "files": None}
    if files is None:
        return {"problems": _unmanifested_problems(path), "files": None}
    return {"problems": [], "files": files}


def _file_problems(
    path: Path, files: Mapping[str, Mapping[str, Any]], names: list[str]
) -> list[str]:
    problems = []
    for name in names:
        entry, file = files[name], path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        size = file.stat().st_size
        if size != int(entry["size"]):
            problems.append(f"{name}: {size} bytes, the manifest says {entry['size']}")
        elif _sha256(file) != entry["sha256"]:
            problems.append(f"{name}: SHA-256 differs from the manifest's (same size)")
    return problems


def verify_checkpoint(path: str | Path) -> Verification:
    """Check a checkpoint before loading it (collective: every rank calls it and gets the
    same :class:`Verification`).

    Rank 0 reads the manifest and broadcasts it; each rank checks a share of the files (size,
    then SHA-256); one gather gives every rank every problem, in the manifest's order. Without
    a manifest, only a checkpoint marked as old (:data:`LEGACY_MARK`) without the format marker
    passes (unverified), after a structural check."""
    folder = Path(path)
    found = from_rank_0("checkpoint verify manifest broadcast", lambda: _plan(folder))
    files = found["files"]
    if files is None:
        return Verification(folder, tuple(found["problems"]), verified=False)
    names = sorted(files)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = _file_problems(folder, files, names[rank::world])
    except OSError as exc:
        mine = [f"rank {rank} could not read it: {type(exc).__name__}: {exc}"]
    problems: list[str] = []
    for part in gather_objects(mine, "checkpoint verify gather"):
        assert isinstance(part, list)
        problems += part
    order = {name: i for i, name in enumerate(names)}
    problems.sort(key=lambda p: order.get(p.split(":")[0], len(order)))
    return Verification(folder, tuple(problems), verified=not problems)


def mark_legacy(path: str | Path) -> Path:
    """Mark the checkpoint ``path``, written before hp-train wrote manifests, as such: write
    :data:`LEGACY_MARK` into it, after which :func:`verify_checkpoint` accepts it unverified
    (structural check only). Returns the mark's path.

    Raises:
        CheckpointError: ``path`` is no checkpoint (no readable ``.metadata``), has a manifest
            (it is verified against it), or holds this version's format marker (its manifest
            was deleted: marking it would load unverified data); or the mark cannot be
            written.
    """
    folder = Path(path)
    if not (folder / _METADATA).is_file():
        raise CheckpointError(f"{folder} is not a checkpoint (no {_METADATA} in it)")
    if (folder / MANIFEST_FILE).exists():
        raise CheckpointError(
            f"{folder} has a {MANIFEST_FILE}: it is verified against it, there is nothing to mark"
        )
    metadata = _read_metadata(folder)
    if isinstance(metadata, str):
        raise CheckpointError(f"{folder}: {metadata}")
    if has_format_marker(metadata):
        raise CheckpointError(
            f"{folder} was written by an hp-train that writes a {MANIFEST_FILE} (its "
            f"{_METADATA} holds the format marker {FORMAT_KEY}), so its manifest was deleted; "
            "refusing to mark it as old, which would load it unverified: restore the manifest "
            "or resume from another checkpoint"
        )
    mark = folder / LEGACY_MARK
    try:
        mark.write_text(
            "This checkpoint was written before hp-train wrote manifest.json; hp-train loads "
            "it unverified (structural check only).\n"
        )
    except OSError as exc:
        raise CheckpointError(f"could not write {mark}: {type(exc).__name__}: {exc}") from exc
    return mark


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
        CheckpointLoadError: torch could not read it on some rank (raised on every rank, after
            one gather: the message names the checkpoint and each failing rank's error); the
            model may then hold part of its data, the optimizer is untouched. Loading another
            checkpoint overwrites both whole. :func:`verify_checkpoint` first finds the
            damage a manifest can show.
    """
    folder = Path(path)
    saved, rng_keys = _saved_layout(folder)
    wanted = 1 if stage is None else stage.stages
    if saved != wanted:
        raise CheckpointMismatchError(
            f"{path} was saved with pp={saved} pipeline stages and this run has pp={wanted}: "
            f"resume with --pp {saved} (the data and tensor-parallel sizes may change)"
        )
    state = _state(model, optimizer, 0, stage)
    rank, world = dist.get_rank(), dist.get_world_size()
    saved_ranks = {key.split(".")[1] for key in rng_keys}
    restore_rng = saved_ranks == {f"rank_{r}" for r in range(world)}
    device = _param_device(model)
    if restore_rng:
        state[_RNG] = {f"rank_{rank}": rng_states(device)}
    elif rank == 0:
        _LOG.warning(
            "%s: %s; the random generators start from this run's seed instead",
            folder,
            f"its random generators' states are of {len(saved_ranks)} ranks, this job has {world}"
            if saved_ranks
            else "it holds no random generators' states (written before hp-train saved them)",
        )
    failure: str | None = None
    try:
        with watch("checkpoint load (torch DCP)"):
            dcp_load(state, checkpoint_id=str(path))
    except CheckpointException as exc:
        failure = _causes(exc)
    # torch's load raises on every rank when one fails to read; agreeing here keeps the ranks
    # together whatever fails where (the model is only touched in place so far).
    failures = [
        f for f in gather_objects(failure, "checkpoint load agreement gather") if f is not None
    ]
    if failures:
        raise CheckpointLoadError(folder, "; ".join(dict.fromkeys(str(f) for f in failures)))
    model.load_state_dict(state["model"])
    optim_sd = state["optim"]
    if stage is not None:
        optim_sd["param_groups"] = state["optim_groups"][stage.key]
    set_optimizer_state_dict(model, optimizer, optim_sd)
    if restore_rng:
        set_rng_states(state[_RNG][f"rank_{rank}"], device)
    return int(state["progress"]["step"])
