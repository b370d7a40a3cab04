"""Training metrics as JSON Lines, and the peak memory of a device.

:class:`MetricsWriter` appends one JSON object per line and flushes after each, so a crash
loses at most the record being written and another process can ``tail -f`` the file. Values
are made JSON-safe: one-element tensors become Python numbers, and non-finite floats (NaN,
+-inf, which strict JSON cannot hold) become ``null`` with their names and kinds listed in
the record's ``"nonfinite"`` field, e.g. ``{"loss": null, "nonfinite": {"loss": "nan"}}``.
:func:`write_json` writes one whole JSON document (the run's ``plan.json``) atomically.
"""

from __future__ import annotations

import json
import math
import operator
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import SupportsFloat, SupportsIndex, TextIO

import torch

__all__ = [
    "MEMORY_LABELS",
    "NONFINITE_KEY",
    "MetricsWriter",
    "memory_key",
    "peak_memory_bytes",
    "per_rank_memory",
    "read_metrics",
    "to_json_record",
    "write_json",
]

NONFINITE_KEY = "nonfinite"
"""The record field naming each non-finite value (dotted path -> ``"nan"``/``"inf"``/``"-inf"``)."""


def _nonfinite_kind(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def _to_json(value: object, name: str, nonfinite: dict[str, str]) -> object:
    """``value`` as a JSON-safe object; non-finite floats become None and go in ``nonfinite``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} is a tensor with {value.numel()} elements (shape "
                f"{tuple(value.shape)}); reduce it to one element first"
            )
        value = value.detach().cpu().item()
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)  # plain int, also for int subclasses
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        nonfinite[name] = _nonfinite_kind(value)
        return None
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"metric {name!r} has a non-str key {key!r}")
            out[key] = _to_json(item, f"{name}.{key}", nonfinite)
        return out
    if isinstance(value, Sequence):
        return [_to_json(item, f"{name}.{i}", nonfinite) for i, item in enumerate(value)]
    if isinstance(value, SupportsIndex):  # e.g. numpy integers
        return operator.index(value)
    if isinstance(value, SupportsFloat):  # e.g. numpy float32
        return _to_json(float(value), name, nonfinite)
    raise TypeError(
        f"metric {name!r} has type {type(value).__name__}, which cannot be written as JSON "
        "(use numbers, strings, bools, None, one-element tensors, lists or dicts)"
    )


def to_json_record(record: Mapping[str, object]) -> dict[str, object]:
    """``record`` converted as :meth:`MetricsWriter.write` stores it (see the module doc).

    Raises:
        ValueError: ``record`` uses the reserved ``"nonfinite"`` key, or holds a tensor with
            more than one element.
        TypeError: a non-str key or a value of a type JSON cannot hold.
    """
    if NONFINITE_KEY in record:
        raise ValueError(f"record key {NONFINITE_KEY!r} is reserved for the non-finite listing")
    nonfinite: dict[str, str] = {}
    out: dict[str, object] = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise TypeError(f"record keys must be str, got {key!r}")
        out[key] = _to_json(value, key, nonfinite)
    if nonfinite:
        out[NONFINITE_KEY] = nonfinite
    return out


class MetricsWriter:
    """Append metric records to ``path`` as JSON Lines (one object per line, flushed).

    The parent directory is created if missing. An existing file is appended to (a resumed
    run continues its log); if it does not end in a newline (a record cut short by a crash),
    a newline is added first so the next record starts on its own line.

    Usable as a context manager, which closes the file on exit.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                needs_newline = fh.read(1) != b"\n"
        self._fh: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        if needs_newline:
            self._fh.write("\n")
            self._fh.flush()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._fh.closed

    def write(self, record: Mapping[str, object]) -> None:
        """Append ``record`` as one JSON line and flush it.

        Raises:
            ValueError: the writer is closed, the reserved ``"nonfinite"`` key is used, or a
                tensor value has more than one element.
            TypeError: a non-str key or a value JSON cannot hold.
        """
        if self._fh.closed:
            raise ValueError(f"write() on a closed MetricsWriter ({self.path})")
        line = json.dumps(to_json_record(record), allow_nan=False, ensure_ascii=False)
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file; calling it again does nothing."""
        self._fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def write_json(path: str | os.PathLike[str], obj: object) -> None:
    """Write ``obj`` (already JSON-ready) to ``path`` as indented strict JSON, atomically:
    into ``<path>.tmp``, then renamed over ``path``, so a reader never sees half a file. The
    parent directory is created if missing.

    Raises:
        ValueError: a non-finite float in ``obj``.
        TypeError: a value JSON cannot hold.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=1, allow_nan=False, ensure_ascii=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, object]]:
    """All records of the JSON Lines file ``path``, in order (blank lines are skipped).

    Raises:
        ValueError: a line that is not a JSON object (the message gives the line number).
    """
    records: list[dict[str, object]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path!s}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path!s}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            records.append(record)
    return records


def peak_memory_bytes(device: torch.device | str) -> int | None:
    """The peak memory used on ``device`` so far, in bytes, or None where it is unknown.

    * Accelerators (CUDA, NPU, XPU, ...): the peak memory occupied by tensors
      (``max_memory_allocated``, since start or the last ``reset_peak_memory_stats``), from
      ``torch.accelerator`` when ``device`` is the current accelerator type, else from the
      device module found with ``torch.get_device_module(device.type)`` when it has
      ``max_memory_allocated`` and reports itself available. It does not include the caching
      allocator's reserved-but-free memory.
    * CPU: the whole process's peak resident set size (``resource.getrusage(RUSAGE_SELF)
      .ru_maxrss``, KiB on Linux, bytes on macOS; converted to bytes). This covers all
      memory of the process, not just tensors, and cannot be reset. None where the
      ``resource`` module is missing (Windows).
    * Anything else (``meta``, unknown types, an accelerator that is not available): None.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_peak_rss_bytes()
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == device.type:
        return int(torch.accelerator.max_memory_allocated(device))
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:
        return None
    max_allocated = getattr(module, "max_memory_allocated", None)
    is_available = getattr(module, "is_available", None)
    if not callable(max_allocated) or not callable(is_available) or not is_available():
        return None
    return int(max_allocated(device))


#: The record key of :func:`peak_memory_bytes`'s figure by what it measures -> its label in
#: the step line and the summary.
MEMORY_LABELS: dict[str, str] = {
    "peak_rss_bytes": "peak RSS",
    "peak_allocated_bytes": "peak allocated",
}
#: The key of runs written before the figure said what it is (read, never written).
_OLD_MEMORY_KEY = "peak_memory_bytes"


def memory_key(device: torch.device | str) -> str:
    """The metrics record key of what :func:`peak_memory_bytes` measures on ``device``:
    ``"peak_rss_bytes"`` (the process's resident set, CPU) or ``"peak_allocated_bytes"``
    (memory occupied by tensors, an accelerator); a key of :data:`MEMORY_LABELS`."""
    return "peak_rss_bytes" if torch.device(device).type == "cpu" else "peak_allocated_bytes"


def per_rank_memory(record: Mapping[str, object]) -> tuple[str, list[int | None]] | None:
    """The per-rank peak memory a metrics record holds, with its key (a key of
    :data:`MEMORY_LABELS`, or ``"peak_memory_bytes"`` in records of older runs, whose figure
    is unlabelled), or None when the record has none."""
    for key in (*MEMORY_LABELS, _OLD_MEMORY_KEY):
        value = record.get(key)
        if isinstance(value, list):
            return key, [v if isinstance(v, int) else None for v in value]
    return None


def _cpu_peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
