"""The run's output folder, checked on every rank before anything is written to it.

A folder that cannot be created or written (read-only, a path through a regular file, a full
or missing mount) is a configuration error every rank finds by itself, at the same point,
instead of an ``OSError`` traceback on the rank that first writes there and broken
connections on the others.
"""

from __future__ import annotations

import os
from pathlib import Path

from hp_train.config.schema import ConfigError

__all__ = ["prepare_out_dir"]


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
