"""The run's metrics as TensorBoard events (``--tensorboard``), beside ``metrics.jsonl``.

Every numeric field of a step's record becomes the scalar ``rl/<field>`` at the record's step
(``eval_accuracy`` becomes ``eval/accuracy``); None and non-finite values are skipped, as
hp-train's event log skips them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hp_rl.config import RLConfigError

__all__ = ["MISSING_TENSORBOARD", "EventLog", "check_tensorboard"]

MISSING_TENSORBOARD = (
    "--tensorboard needs the tensorboard package: pip install 'hp-rl[tensorboard]' "
    "(or pip install tensorboard)"
)

# Fields of a record that are not measurements.
_NOT_SCALARS = frozenset({"step", "policy_version"})


def check_tensorboard() -> None:
    """Raise :class:`RLConfigError` (:data:`MISSING_TENSORBOARD`) unless TensorBoard's writer
    can be imported: checked before the job starts, not after its set-up."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise RLConfigError(f"{MISSING_TENSORBOARD} ({exc})") from None


def tag_of(field: str) -> str:
    """The TensorBoard tag of a record's field."""
    return "eval/accuracy" if field == "eval_accuracy" else f"rl/{field}"


class EventLog:
    """An event file in ``log_dir`` (created if missing)."""

    def __init__(self, log_dir: Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: Mapping[str, object]) -> None:
        """The numeric fields of ``record`` at its ``step``."""
        step = record["step"]
        assert isinstance(step, int)
        for field, value in record.items():
            if field in _NOT_SCALARS or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                self._writer.add_scalar(tag_of(field), float(value), global_step=step)

    def close(self) -> None:
        """Flush and close the file."""
        self._writer.close()
