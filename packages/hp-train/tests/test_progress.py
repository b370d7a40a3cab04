"""Tests for hp_train.observe.progress: tqdm's redraws on a TTY, whole lines in a log, rank
gating."""

from __future__ import annotations

import io
import re

import pytest
import torch

from hp_train.observe.progress import ProgressBar, format_value


class FakeTTY(io.StringIO):
    """A StringIO that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


def test_tty_redraws_one_line_in_place_with_the_fields() -> None:
    stream = FakeTTY()
    bar = ProgressBar(enabled=True, stream=stream, min_interval_s=0)
    assert bar.is_tty
    bar.update(1, 4, loss=10.5, **{"tok/s": 12345.0})
    bar.update(2, 4, loss=9.5)
    bar.update(3, 4)
    assert "\n" not in stream.getvalue()
    assert stream.getvalue().startswith("\r")
    bar.close()
    out = stream.getvalue()
    assert out.endswith("\n")
    assert out.count("\n") == 1
    states = [s.rstrip() for s in out[:-1].split("\r") if s]
    meter = r"\[\d\d:\d\d<(\?|\d\d:\d\d), +(\?|[\d.]+)step/s"
    assert re.fullmatch(r" 25%\|.{10}\| 1/4 " + meter + r", loss=10\.5, tok/s=1\.2e4\]", states[0])
    assert any(re.fullmatch(r" 50%\|.{10}\| 2/4 " + meter + r", loss=9\.5\]", s) for s in states)
    assert re.fullmatch(r" 75%\|.{10}\| 3/4 " + meter + r"\]", states[-1])
    bar.close()  # idempotent
    assert stream.getvalue() == out


def test_tty_redraws_are_rate_limited_by_tqdm() -> None:
    stream = FakeTTY()
    with ProgressBar(enabled=True, stream=stream, min_interval_s=3600) as bar:
        for step in range(1, 6):
            bar.update(step, 5, loss=float(step))
    states = [s for s in stream.getvalue().split("\r") if s]
    # The first state when the bar appears, then (within the hour) only close()'s final one.
    assert len(states) == 2
    assert "1/5" in states[0]
    assert "5/5" in states[1]
    assert "loss=5" in states[1]


def test_log_mode_writes_every_n_updates_and_the_last_step() -> None:
    stream = io.StringIO()
    clock = FakeClock()
    bar = ProgressBar(enabled=True, stream=stream, every=3, clock=clock)
    assert not bar.is_tty
    for step in range(1, 11):
        bar.update(step, 10, loss=step + 0.5)
        clock.now += 0.5
    bar.close()
    assert "\r" not in stream.getvalue()
    # tqdm's meter, with the elapsed time, rate and time left of the fake clock (2 steps/s).
    assert stream.getvalue().splitlines() == [
        " 10%|#         | 1/10 [00:00<?, ?step/s, loss=1.5]",
        " 40%|####      | 4/10 [00:01<00:03,  2.00step/s, loss=4.5]",
        " 70%|#######   | 7/10 [00:03<00:01,  2.00step/s, loss=7.5]",
        "100%|##########| 10/10 [00:04<00:00,  2.00step/s, loss=10.5]",
    ]


def test_log_mode_rate_counts_from_the_first_update_of_a_resumed_run() -> None:
    stream = io.StringIO()
    clock = FakeClock()
    with ProgressBar(enabled=True, stream=stream, every=2, clock=clock) as bar:
        bar.update(41, 100)
        clock.now += 4.0
        bar.update(42, 100)
        bar.update(43, 100)
    lines = stream.getvalue().splitlines()
    assert lines[0] == " 41%|####1     | 41/100 [00:00<?, ?step/s]"
    # 2 steps in 4 s since step 41 (not 43 steps): 0.5 step/s, 57 steps left = 114 s.
    assert lines[1] == " 43%|####3     | 43/100 [00:04<01:54,  2.00s/step]"


def test_log_mode_close_writes_the_unshown_last_state() -> None:
    stream = io.StringIO()
    with ProgressBar(enabled=True, stream=stream, every=100, clock=FakeClock()) as bar:
        bar.update(1, 50)
        bar.update(2, 50, loss=1.5)
        assert stream.getvalue().count("\n") == 1
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0] == "  2%|2         | 1/50 [00:00<?, ?step/s]"
    assert lines[1] == "  4%|4         | 2/50 [00:00<?, ?step/s, loss=1.5]"


def test_log_mode_close_does_not_repeat_a_written_line() -> None:
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, every=1)
    bar.update(1, 2)
    bar.close()
    assert stream.getvalue().count("\n") == 1
    assert "1/2" in stream.getvalue()


def test_tty_override() -> None:
    forced_tty = ProgressBar(enabled=True, stream=io.StringIO(), tty=True)
    assert forced_tty.is_tty
    forced_log = ProgressBar(enabled=True, stream=FakeTTY(), tty=False)
    assert not forced_log.is_tty


@pytest.mark.parametrize("stream_type", [FakeTTY, io.StringIO])
def test_disabled_bar_writes_nothing_but_checks_arguments(stream_type: type[io.StringIO]) -> None:
    stream = stream_type()
    bar = ProgressBar(enabled=False, stream=stream, min_interval_s=0)
    for step in range(1, 6):
        bar.update(step, 5, loss=1.0)
    bar.close()
    assert stream.getvalue() == ""
    other_rank = ProgressBar(False, stream=stream)
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
    [
        ({"every": 0}, "every"),
        ({"every": 2.5}, "every"),
        ({"min_interval_s": -1}, "min_interval_s"),
    ],
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
