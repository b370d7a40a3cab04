"""What data a run reads: :class:`DataSpec`, checked when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hp_train.config.schema import ConfigError, check_positive
from hp_train.data.documents import BUILTIN_SOURCES, not_found_message

__all__ = ["DataSpec"]


@dataclass(frozen=True)
class DataSpec:
    """The data of a run (see :mod:`hp_train.data.documents` for what each input's documents are).

    Attributes:
        source: ``"corpus"``, ``"synthetic"``, ``"pydoc"`` or a local file or folder (text,
            JSON Lines/JSON, Parquet). A local path named like a built-in: ``./NAME``.
        text_field: the field of JSON Lines/Parquet rows that holds a document (in
            ``eval_data`` too).
        eval_fraction: the share of documents held out for validation, each document drawn
            independently from the seed (:func:`hp_train.data.order.is_held_out`); never trained on.
        eval_data: a separate local file or folder to validate on instead (every document of
            it); then ``eval_fraction`` stays 0.
        streaming: read local files lazily with bounded memory (True), whole into memory
            (False), or by their size (None: streamed above
            :data:`hp_train.data.documents.STREAMING_THRESHOLD_BYTES`). The batches are the same.
        shuffle_documents: documents are shuffled within groups of this many, in each epoch.
        shuffle_windows: windows are shuffled within blocks of this many.
    """

    source: str = "corpus"
    text_field: str = "text"
    eval_fraction: float = 0.0
    eval_data: str | None = None
    streaming: bool | None = None
    shuffle_documents: int = 256
    shuffle_windows: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError(f"data source must be a built-in name or a path, got {self.source!r}")
        if self.source not in BUILTIN_SOURCES and not Path(self.source).expanduser().exists():
            raise ConfigError(not_found_message("data", self.source))
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ConfigError(f"text_field must name a field, got {self.text_field!r}")
        fraction = self.eval_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not math.isfinite(fraction)
            or not 0.0 <= fraction < 1.0
        ):
            raise ConfigError(
                f"eval_fraction is the share of documents held out, in [0, 1), got {fraction!r}"
            )
        if self.eval_data is not None:
            if not isinstance(self.eval_data, str) or not self.eval_data:
                raise ConfigError(f"eval_data must be a local path, got {self.eval_data!r}")
            if self.eval_data in BUILTIN_SOURCES or not Path(self.eval_data).expanduser().exists():
                raise ConfigError(not_found_message("eval_data", self.eval_data, builtins=False))
            if fraction > 0:
                raise ConfigError(
                    f"eval_fraction={fraction} holds out documents of the training data and "
                    f"eval_data={self.eval_data!r} gives others: choose one"
                )
        if self.streaming is not None and not isinstance(self.streaming, bool):
            raise ConfigError(f"streaming must be True, False or None, got {self.streaming!r}")
        check_positive("shuffle_documents", self.shuffle_documents)
        check_positive("shuffle_windows", self.shuffle_windows)

    @property
    def has_eval(self) -> bool:
        """Whether the run has a validation split."""
        return self.eval_fraction > 0 or self.eval_data is not None
