"""Tests for hp_train.observe.logs: rank 0's console, every rank's file, idempotent setup,
warnings."""

from __future__ import annotations

import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from hp_testing import run_on_ranks
from hp_train.observe.logs import (
    CONSOLE,
    FILE_ONLY,
    LOGGER_NAME,
    close_logging,
    console_is_terminal,
    log_file,
    setup_logging,
)
from hp_train.observe.progress import ProgressBar

# A file line: "2031-01-02 03:04:05,678 rank 1 INFO hp_train.trainer: message".
FILE_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} rank (?P<rank>\d+) (?P<level>[A-Z]+) "
    r"(?P<name>[\w.]+): (?P<message>.*)"
)


@pytest.fixture(autouse=True)
def _closed_after() -> Iterator[None]:
    yield
    close_logging()


def file_lines(out_dir: Path, rank: int) -> list[tuple[int, str, str, str]]:
    """(rank, level, logger, message) of each line of ``rank``'s log file; every line parses."""
    parsed = []
    for line in log_file(out_dir, rank).read_text(encoding="utf-8").splitlines():
        match = FILE_LINE.fullmatch(line)
        assert match, line
        parsed.append((int(match["rank"]), match["level"], match["name"], match["message"]))
    return parsed


def _two_runs(out_dir: str) -> str:
    """Two runs' logging in one rank process; what the rank printed on its console."""
    rank = dist.get_rank()
    console = io.StringIO()
    real_stderr, sys.stderr = sys.stderr, console
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for run in (1, 2):
                setup_logging(out_dir, rank)
                logging.getLogger("hp_train.trainer").info("run %d on rank %d", run, rank)
                logging.getLogger("hp_train.trainer").debug("not at INFO")
                warnings.warn(f"careful in run {run}", UserWarning, stacklevel=1)
            close_logging()
    finally:
        sys.stderr = real_stderr
    return console.getvalue()


@pytest.mark.multiprocess
def test_rank_0_speaks_every_rank_writes_its_file_without_duplicates(tmp_path: Path) -> None:
    consoles = run_on_ranks(2, _two_runs, str(tmp_path))
    assert consoles[1] == ""
    here = Path(__file__).name
    said = re.compile(
        r"run 1 on rank 0\n"
        rf"WARNING: UserWarning: careful in run 1 \(.*{here}:\d+\)\n"
        r"run 2 on rank 0\n"
        rf"WARNING: UserWarning: careful in run 2 \(.*{here}:\d+\)\n"
    )
    assert said.fullmatch(consoles[0]), consoles[0]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]
    for rank in (0, 1):
        lines = file_lines(tmp_path, rank)
        assert [line[:3] for line in lines] == [
            (rank, "INFO", "hp_train.trainer"),
            (rank, "WARNING", "hp_train.warnings"),
        ] * 2
        assert lines[0][3] == f"run 1 on rank {rank}"
        assert lines[1][3].startswith("UserWarning: careful in run 1 (")
        assert lines[2][3] == f"run 2 on rank {rank}"
        assert lines[3][3].startswith("UserWarning: careful in run 2 (")


def test_quiet_keeps_warnings_on_the_console_and_everything_in_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = setup_logging(tmp_path, 0, quiet=True)
    assert logger.name == LOGGER_NAME
    logging.getLogger("hp_train.data.loader").info("read 3 files")
    logging.getLogger("hp_train.data.loader").error("file 4 is empty")
    assert capsys.readouterr().err == "ERROR: file 4 is empty\n"
    assert [line[1:] for line in file_lines(tmp_path, 0)] == [
        ("INFO", "hp_train.data.loader", "read 3 files"),
        ("ERROR", "hp_train.data.loader", "file 4 is empty"),
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_file_only_records_and_the_terminal_question(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``extra=FILE_ONLY`` keeps a record off the console (the run's header and end line, and
    the step lines while a terminal shows the progress bar); :func:`console_is_terminal` asks
    the console of the set-up, not of this moment."""
    for console, tty in ((io.StringIO(), False), (_Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", console)
        setup_logging(tmp_path / str(tty), 0)
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert console_is_terminal() is tty
        log = logging.getLogger("hp_train.trainer")
        log.info("==== header ====", extra=FILE_ONLY)
        log.info("step 1/2", extra={CONSOLE: not tty})
        log.warning("careful")
        close_logging()
        assert console.getvalue() == ("" if tty else "step 1/2\n") + "WARNING: careful\n"
        assert [m for *_, m in file_lines(tmp_path / str(tty), 0)] == [
            "==== header ====",
            "step 1/2",
            "careful",
        ]
    assert console_is_terminal() is False  # no logging set up
    setup_logging(tmp_path, 1)
    assert console_is_terminal() is False  # a rank without a console


def test_level_applies_to_console_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(tmp_path, 0, level=logging.DEBUG)
    logging.getLogger("hp_train.optim").debug("muon groups: 4")
    assert capsys.readouterr().err == "muon groups: 4\n"
    assert file_lines(tmp_path, 0) == [(0, "DEBUG", "hp_train.optim", "muon groups: 4")]


def test_close_logging_undoes_the_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger(LOGGER_NAME)
    before = (list(logger.handlers), logger.level, logger.propagate, warnings.showwarning)
    setup_logging(tmp_path, 3)
    assert len(logger.handlers) == len(before[0]) + 1  # rank 3: its file only
    assert logger.propagate is False  # the root logger's handlers would print it again
    assert warnings.showwarning is not before[3]
    close_logging()
    close_logging()  # idempotent
    assert (list(logger.handlers), logger.level, logger.propagate, warnings.showwarning) == before
    logging.getLogger("hp_train.trainer").warning("after the run")
    assert file_lines(tmp_path, 3) == []
    capsys.readouterr()


def test_warnings_to_an_explicit_file_still_go_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[tuple[object, ...]] = []

    def previous(*args: object) -> None:
        shown.append(args)

    monkeypatch.setattr(warnings, "showwarning", previous)
    setup_logging(tmp_path, 1)
    target = io.StringIO()
    warnings.showwarning("odd", RuntimeWarning, "x.py", 7, file=target)
    assert shown == [("odd", RuntimeWarning, "x.py", 7, target, None)]
    assert file_lines(tmp_path, 1) == []
    close_logging()
    assert warnings.showwarning is previous


def test_a_console_message_does_not_tear_the_progress_bar(tmp_path: Path) -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = FakeTTY()
    real_stderr, sys.stderr = sys.stderr, terminal
    try:
        setup_logging(tmp_path, 0)
        with ProgressBar(enabled=True, min_interval_s=0) as bar:
            bar.update(1, 4)
            logging.getLogger("hp_train.trainer").info("saved checkpoint step_000001")
            bar.update(2, 4)
    finally:
        sys.stderr = real_stderr
    # tqdm.write clears the bar's line ("\r" + blanks + "\r"), writes the message as a line of
    # its own and redraws the bar after it.
    lines = terminal.getvalue().split("\n")
    message = [line for line in lines if "saved checkpoint" in line]
    assert len(message) == 1
    assert message[0].split("\r")[-1] == "saved checkpoint step_000001"
    assert set(message[0].split("\r")[-2]) <= {" "}
    assert "1/4" in message[0]  # the bar's state before the message, on the same line
    assert "2/4" in lines[-2]


@pytest.mark.parametrize(
    ("rank", "level", "match"),
    [(-1, logging.INFO, "rank"), (True, logging.INFO, "rank"), (0, "INFO", "level")],
)
def test_bad_arguments(tmp_path: Path, rank: object, level: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        setup_logging(tmp_path, rank, level=level)  # type: ignore[arg-type]
    assert not (tmp_path / "logs").exists()
