"""A run's logging: rank 0 speaks on the console, every rank writes its own log file.

:func:`setup_logging` configures the ``hp_train`` logger (and so every ``hp_train.*`` module
logger) for one run:

* every rank appends to ``<out_dir>/logs/rank_<r>.log``, each line with its time and rank:
  ``2031-01-02 03:04:05,678 rank 1 INFO hp_train.trainer: resumed at step 40``;
* rank 0 also prints to ``sys.stderr`` (the message alone; ``WARNING: ...`` from warnings up),
  through ``tqdm.write`` so a message does not tear a progress bar drawn on the same terminal;
  ``quiet`` keeps only warnings and errors there. Other ranks print nothing, so a job of 64
  ranks does not say everything 64 times. A record logged with ``extra=FILE_ONLY`` (or
  ``extra={CONSOLE: False}``) goes to the file alone: the run's header and end line, and the
  step lines while the console is a terminal that shows the progress bar instead
  (:func:`console_is_terminal`);
* warnings of the :mod:`warnings` module (hp_train's, and those of the libraries it calls, as
  torch's) become records of the ``hp_train.warnings`` logger while the run's logging is set
  up, so they land in the rank's log file (and on rank 0's console) instead of every rank's
  stderr. A warning shown to an explicit file (``warnings.showwarning(..., file=f)``) still
  goes there.

The libraries' own loggers in :data:`LIBRARY_LOGGERS` (the collective watchdog's diagnosis of
a stalled or lost rank, logged before it is raised, so that it reaches the file even when the
launcher stops the process at once) write into the same file, at WARNING and above.

The ``hp_train`` logger stops propagating to the root logger meanwhile, so an application
that configured root logging does not print each message twice. :func:`close_logging` undoes
all of it; :func:`setup_logging` calls it first, so a second run in one process (as the tests
do) replaces the first run's handlers rather than adding to them.
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

# tqdm ships no type hints (types-tqdm is not a dependency): its objects are Any here.
from tqdm import tqdm  # type: ignore[import-untyped]

__all__ = [
    "CONSOLE",
    "FILE_ONLY",
    "LIBRARY_LOGGERS",
    "LOGGER_NAME",
    "LOG_DIR",
    "WARNINGS_LOGGER_NAME",
    "close_logging",
    "console_is_terminal",
    "file_formatter",
    "log_file",
    "setup_logging",
]

#: The logger :func:`setup_logging` configures; modules log through ``hp_train.<module>``.
LOGGER_NAME = "hp_train"
#: Where warnings of the :mod:`warnings` module are logged while logging is set up.
WARNINGS_LOGGER_NAME = "hp_train.warnings"
#: Loggers of the libraries whose warnings and errors go into the rank's log file too.
LIBRARY_LOGGERS = ("hp_dtensor",)
#: The folder of the per-rank log files, inside the run's output directory.
LOG_DIR = "logs"
#: The record attribute that, False, keeps a record off the console (``extra={CONSOLE: ...}``).
CONSOLE = "hp_console"
#: ``extra=`` of a record for the log file alone.
FILE_ONLY: dict[str, object] = {CONSOLE: False}


class _ShowWarning(Protocol):
    """The signature of ``warnings.showwarning``."""

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None: ...


def log_file(out_dir: str | Path, rank: int) -> Path:
    """The log file of ``rank`` in the run directory ``out_dir``: ``logs/rank_<rank>.log``."""
    return Path(out_dir) / LOG_DIR / f"rank_{rank}.log"


class _ConsoleFormatter(logging.Formatter):
    """The message alone, with ``LEVEL: `` in front from warnings up."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname}: {text}" if record.levelno >= logging.WARNING else text


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """Writes through ``tqdm.write``: a bar on the same stream is cleared and redrawn; skips
    records marked for the file alone (:data:`FILE_ONLY`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, CONSOLE, True)) and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


@dataclass
class _Installed:
    """What :func:`setup_logging` changed, for :func:`close_logging` to undo."""

    handlers: list[logging.Handler]
    # The library loggers' file handler and their levels before.
    library_handler: logging.Handler
    library_levels: list[int]
    level: int
    propagate: bool
    previous_showwarning: _ShowWarning


_installed: _Installed | None = None


def file_formatter(rank: int) -> logging.Formatter:
    """The format of a rank's log file: time, rank, level, logger, message."""
    return logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")


def setup_logging(
    out_dir: str | Path, rank: int, *, quiet: bool = False, level: int = logging.INFO
) -> logging.Logger:
    """Set up this process's logging for a run in ``out_dir`` as ``rank``; return the logger.

    Postconditions: the ``hp_train`` logger has ``level`` and exactly one file handler
    (appending to :func:`log_file`, created with its folder if missing), plus on rank 0 one
    console handler on the ``sys.stderr`` of this moment at ``level`` (``quiet``: at least
    WARNING); it does not propagate to the root logger; warnings of the :mod:`warnings`
    module are logged as described in the module docstring; the loggers of
    :data:`LIBRARY_LOGGERS` have the same file handler and a level of WARNING or lower. Any
    earlier call's handlers were removed and closed first.

    Raises:
        ValueError: ``rank`` not a non-negative int, or ``level`` not an int logging level.
    """
    global _installed
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if isinstance(level, bool) or not isinstance(level, int) or level < 0:
        raise ValueError(f"level must be an int logging level such as logging.INFO, got {level!r}")
    close_logging()
    path = log_file(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode="a", encoding="utf-8")
    to_file.setLevel(level)
    to_file.setFormatter(file_formatter(rank))
    handlers: list[logging.Handler] = [to_file]
    if rank == 0:
        console = _ConsoleHandler(sys.stderr)
        console.setLevel(max(level, logging.WARNING) if quiet else level)
        console.setFormatter(_ConsoleFormatter("%(message)s"))
        handlers.append(console)
    logger = logging.getLogger(LOGGER_NAME)
    libraries = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    _installed = _Installed(
        handlers=handlers,
        library_handler=to_file,
        library_levels=[library.level for library in libraries],
        level=logger.level,
        propagate=logger.propagate,
        previous_showwarning=warnings.showwarning,
    )
    logger.setLevel(level)
    logger.propagate = False
    for handler in handlers:
        logger.addHandler(handler)
    for library in libraries:
        library.addHandler(to_file)
        if library.getEffectiveLevel() > logging.WARNING:
            library.setLevel(logging.WARNING)
    warnings.showwarning = _log_warning
    return logger


def console_is_terminal() -> bool:
    """Whether the console of the run's logging (rank 0's ``sys.stderr`` when it was set up)
    is a terminal; False without a console (other ranks, or logging not set up)."""
    if _installed is None:
        return False
    for handler in _installed.handlers:
        if isinstance(handler, _ConsoleHandler):
            isatty = getattr(handler.stream, "isatty", None)
            return bool(isatty()) if callable(isatty) else False
    return False


def close_logging() -> None:
    """Undo :func:`setup_logging`: remove and close its handlers, restore the logger's level
    and propagation and the :mod:`warnings` display. Does nothing when logging is not set up.

    A ``warnings.showwarning`` that someone installed after :func:`setup_logging` is left in
    place (it is theirs).
    """
    global _installed
    installed, _installed = _installed, None
    if installed is None:
        return
    logger = logging.getLogger(LOGGER_NAME)
    for handler in installed.handlers:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(installed.level)
    logger.propagate = installed.propagate
    for name, level in zip(LIBRARY_LOGGERS, installed.library_levels, strict=True):
        library = logging.getLogger(name)
        library.removeHandler(installed.library_handler)
        library.setLevel(level)
    if warnings.showwarning is _log_warning:
        warnings.showwarning = installed.previous_showwarning


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` while logging is set up: one WARNING record per warning."""
    if file is not None and _installed is not None:
        _installed.previous_showwarning(message, category, filename, lineno, file, line)
        return
    logging.getLogger(WARNINGS_LOGGER_NAME).warning(
        "%s: %s (%s:%d)", category.__name__, message, filename, lineno
    )
