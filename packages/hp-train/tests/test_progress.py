"""Tests for hp_train.progress: line format, TTY redraws, log-mode lines, rank gating."""

from __future__ import annotations

import io

import pytest
import torch

from hp_train.progress import ProgressBar, format_value


class FakeTTY(io.StringIO):
    """A StringIO that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


def test_line_format() -> None:
    bar = ProgressBar(enabled=True, stream=io.StringIO())
    line = bar.render(5, 20, loss=3.2109, **{"tok/s": 12345.0})
    assert line == "[#####...............] 5/20 loss 3.21 tok/s 1.2e4"
    assert bar.render(0, 20) == "[....................] 0/20"
    assert bar.render(20, 20) == "[####################] 20/20"
    assert bar.render(25, 20) == "[####################] 25/20"  # past the end: full, no error
    narrow = ProgressBar(enabled=True, stream=io.StringIO(), width=4)
    assert narrow.render(1, 3, lr=3e-4, step_time=0.25) == "[#...] 1/3 lr 3.0e-4 step_time 0.25"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3, "3"),
        (123456789, "123456789"),
        (True, "True"),
        ("warmup", "warmup"),
        (0.0, "0"),
        (3.21, "3.21"),
        (0.012345, "0.0123"),
        (123.456, "123"),
        (9999.4, "9999"),
        (12345.0, "1.2e4"),
        (-2.5e-5, "-2.5e-5"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        (torch.tensor(2.5), "2.5"),
        (torch.tensor([1.0, 2.0]), str(torch.tensor([1.0, 2.0]))),
        (None, "None"),
    ],
)
def test_format_value(value: object, text: str) -> None:
    assert format_value(value) == text


def test_tty_redraws_one_line_in_place() -> None:
    stream = FakeTTY()
    bar = ProgressBar(enabled=True, stream=stream, width=4)
    assert bar.is_tty
    bar.update(1, 4, loss=10.5)
    bar.update(2, 4, loss=9.5)
    bar.update(3, 4)
    assert "\n" not in stream.getvalue()
    bar.close()
    out = stream.getvalue()
    # The shorter third line is padded with spaces to erase the end of the longer one.
    assert out == ("\r[#...] 1/4 loss 10.5\r[##..] 2/4 loss 9.5 \r[###.] 3/4         \n")
    bar.close()  # idempotent
    assert stream.getvalue() == out


def test_log_mode_writes_every_n_updates_and_the_last_step() -> None:
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, width=10, every=3)
    assert not bar.is_tty
    for step in range(1, 11):
        bar.update(step, 10, loss=step + 0.5)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "[#.........] 1/10 loss 1.5",
        "[####......] 4/10 loss 4.5",
        "[#######...] 7/10 loss 7.5",
        "[##########] 10/10 loss 10.5",
    ]


def test_log_mode_close_writes_the_unshown_last_state() -> None:
    stream = io.StringIO()
    with ProgressBar(enabled=True, stream=stream, every=100, width=5) as bar:
        bar.update(1, 50)
        bar.update(2, 50, loss=1.5)
        assert stream.getvalue() == "[.....] 1/50\n"
    assert stream.getvalue() == "[.....] 1/50\n[.....] 2/50 loss 1.5\n"


def test_log_mode_close_does_not_repeat_a_written_line() -> None:
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, every=1, width=2)
    bar.update(1, 2)
    bar.close()
    assert stream.getvalue() == "[#.] 1/2\n"


def test_tty_override() -> None:
    forced_tty = ProgressBar(enabled=True, stream=io.StringIO(), tty=True)
    assert forced_tty.is_tty
    forced_log = ProgressBar(enabled=True, stream=FakeTTY(), tty=False)
    assert not forced_log.is_tty


def test_disabled_bar_writes_nothing_but_checks_arguments() -> None:
    stream = FakeTTY()
    bar = ProgressBar(enabled=False, stream=stream)
    for step in range(5):
        bar.update(step, 5, loss=1.0)
    bar.close()
    assert stream.getvalue() == ""
    other_rank = ProgressBar(enabled=False, stream=stream)
    with pytest.raises(ValueError, match="total"):
        other_rank.update(1, 0)


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(enabled=True, every=1)
    bar.update(1, 2)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "1/2" in captured.err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"width": 0}, "width"), ({"every": 0}, "every"), ({"width": 2.5}, "width")],
)
def test_bad_constructor_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProgressBar(enabled=True, stream=io.StringIO(), **kwargs)  # type: ignore[arg-type]


def test_bad_update_arguments() -> None:
    bar = ProgressBar(enabled=True, stream=io.StringIO())
    with pytest.raises(ValueError, match="total"):
        bar.update(0, 0)
    with pytest.raises(ValueError, match="step"):
        bar.update(-1, 10)
    with pytest.raises(ValueError, match="step"):
        bar.update(1.5, 10)  # type: ignore[arg-type]
    bar.close()
    with pytest.raises(ValueError, match="closed"):
        bar.update(1, 10)
