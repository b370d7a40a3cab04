"""The run's output folder: checked on every rank before anything is written to it, and held
by one run at a time.

A folder that cannot be created or written (read-only, a path through a regular file, a full
or missing mount) is a configuration error every rank finds by itself, at the same point,
instead of an ``OSError`` traceback on the rank that first writes there and broken
connections on the others.

A folder belongs to one run at a time: rank 0 takes ``run.lock`` (its host, pid, start time
and torchrun's run id) before anything is written and removes it at the end. A second run on
a held folder is refused naming the owner; a lock whose owner is gone (same host, no such
process), or an earlier attempt of the same torchrun job, is taken over with a warning.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from hp_train.config.schema import ConfigError

__all__ = [
    "LOCK_FILE",
    "LockOwner",
    "OutDirInUseError",
    "claim_out_dir",
    "prepare_out_dir",
    "release_out_dir",
]


def prepare_out_dir(out_dir: Path, rank: int) -> None:
    """Create ``out_dir`` (with its parents) and check that this rank can write a file in it.

    Postconditions: ``out_dir`` exists and holds no file of the check.

    Raises:
        ConfigError: the folder cannot be created or written (the message names the folder,
            the system's reason and what to do).
    """
    probe = out_dir / f".hp_train_write_check_rank_{rank}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as handle:
            handle.write("ok\n")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"--out {out_dir}: cannot write there ({exc.strerror or exc}); choose a folder "
            "this job can create and write"
        ) from None


#: The output folder's lock: one run writes into a folder at a time.
LOCK_FILE = "run.lock"


class OutDirInUseError(ConfigError):
    """Another run holds the output folder (nothing of this run may be written there, its log
    files included)."""


@dataclass(frozen=True)
class LockOwner:
    """The run holding an output folder.

    Attributes:
        host: the host its rank 0 runs on.
        pid: its rank 0's process id.
        started: when it took the folder (ISO 8601, UTC).
        job: torchrun's run id (a restart of the same job takes its own folder back).
    """

    host: str
    pid: int
    started: str
    job: str

    @staticmethod
    def here() -> LockOwner:
        """This process, now."""
        return LockOwner(
            socket.gethostname(),
            os.getpid(),
            datetime.now(UTC).isoformat(timespec="seconds"),
            os.environ.get("TORCHELASTIC_RUN_ID", ""),
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def alive(self) -> bool | None:
        """Whether the owner still runs: None where that cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True


def _read_owner(lock: Path) -> LockOwner | None:
    try:
        fields = json.loads(lock.read_text())
        return LockOwner(
            str(fields["host"]),
            int(fields["pid"]),
            str(fields["started"]),
            str(fields.get("job", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim_out_dir(out_dir: Path) -> str | None:
    """Take ``out_dir`` for this run (rank 0 calls it once, after :func:`prepare_out_dir`).

    The lock file is created atomically; a lock left by a run that is gone (same host, no
    such process), by an earlier attempt of this torchrun job or unreadable is taken over.

    Returns:
        a warning to show when a stale lock was taken over, else None.

    Raises:
        OutDirInUseError: another live run holds the folder, or one on another host (the
            message names it and how to proceed).
    """
    lock = out_dir / LOCK_FILE
    me = LockOwner.here()
    text = json.dumps(asdict(me)) + "\n"
    try:
        with open(lock, "x", encoding="utf-8") as handle:
            handle.write(text)
        return None
    except FileExistsError:
        pass
    owner = _read_owner(lock)
    warning = None
    if owner is not None and not (me.job and owner.job == me.job):
        alive = owner.alive()
        if alive is not False:
            where = (
                "is still running" if alive else "runs on another host, where it cannot be checked"
            )
            raise OutDirInUseError(
                f"--out {out_dir} is in use by another run ({owner.describe()}), which {where}; "
                f"use another --out, or stop that run (if it is gone, delete {lock})"
            )
        warning = f"--out {out_dir}: took over the lock of a run that is gone ({owner.describe()})"
    lock.write_text(text)
    return warning


def release_out_dir(out_dir: Path) -> None:
    """Remove this run's lock from ``out_dir`` (rank 0, at the end; a lock another run holds
    is left alone)."""
    lock = out_dir / LOCK_FILE
    owner = _read_owner(lock)
    if owner is not None and owner.pid == os.getpid() and owner.host == socket.gethostname():
        lock.unlink(missing_ok=True)
