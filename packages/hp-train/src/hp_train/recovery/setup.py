"""Where a run's snapshots live and which run they belong to.

* The **host folder**: ``--snapshot-dir``, else ``/dev/shm/hp_train/<key>`` (memory that
  outlives the worker processes; the system's temporary folder where there is no
  ``/dev/shm``), ``<key>`` a hash of the output folder's absolute path, so that two runs on
  one host keep apart and a restart of a run finds its own.
* The **host**: two ranks share a host when they see the same folder on the same machine
  (``<hostname>:<folder>``); two torchrun agents on one machine given two folders are two
  hosts, which is how the tests play a two-host job on one machine.
* The **run id**: a new run (no ``--resume``) draws one and writes it into
  ``<out>/run_id``; a resumed or restarted run reads it, so it takes only its own run's
  snapshots, never those an earlier run in the same output folder left behind.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import uuid
from pathlib import Path

from hp_train.objects import from_rank_0

__all__ = ["RUN_ID_FILE", "host_name", "run_id", "snapshot_root"]

#: The run's id in its output folder.
RUN_ID_FILE = "run_id"


def snapshot_root(out_dir: Path, given: Path | None) -> Path:
    """This host's snapshot folder for the run writing into ``out_dir`` (module docstring)."""
    if given is not None:
        return given
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    key = hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:16]
    return base / "hp_train" / key


def host_name(root: Path) -> str:
    """The name of this rank's host for the recovery planner: ``<hostname>:<folder>``."""
    return f"{socket.gethostname()}:{os.path.realpath(root)}"


def run_id(out_dir: Path, new: bool) -> str:
    """The run's id as rank 0 has it (collective: one broadcast): a new one written into
    ``out_dir/run_id`` when ``new`` or when there is none, else the one there."""

    def read_or_draw() -> str:
        path = out_dir / RUN_ID_FILE
        if not new and path.is_file():
            text = path.read_text().strip()
            if text:
                return text
        drawn = uuid.uuid4().hex
        path.write_text(drawn + "\n")
        return drawn

    return from_rank_0("broadcast_object_list (run id)", read_or_draw)
