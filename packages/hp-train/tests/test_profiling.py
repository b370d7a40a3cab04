"""Tests for hp_train.observe.profiling: step lists, and Chrome traces of real steps read back.

Oracle for the operator counts: a step of ``Linear(8, 16) -> ReLU -> Linear(16, 4)`` (no
biases) on an input that needs no gradient runs 5 matrix products: 2 in forward, and in
backward one weight gradient per layer plus the input gradient of the second layer only
(the first layer's input needs none).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_testing import run_on_ranks
from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError
from hp_train.observe.profiling import (
    StepListError,
    StepProfiler,
    parse_step_ranges,
    profiler_activities,
    step_list_option,
)

MATMULS_PER_STEP = 5


def _model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    return model, torch.optim.AdamW(model.parameters()), torch.randn(32, 8)


def _train(profiler: StepProfiler, steps: range) -> dict[int, str | None]:
    model, optimizer, x = _model()
    tables = {}
    for step in steps:
        profiler.step_begin(step)
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tables[step] = profiler.step_end(step)
    profiler.close()
    return tables


def _complete_events(path: Path) -> Counter[str]:
    """Complete ("X") events of a Chrome trace by name, read with json alone."""
    trace = json.loads(path.read_text())
    return Counter(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")


def test_parse_step_ranges() -> None:
    assert parse_step_ranges("5") == (5,)
    assert parse_step_ranges("5,7") == (5, 7)
    assert parse_step_ranges("5-7") == (5, 6, 7)
    assert parse_step_ranges(" 7, 2-3 ,3") == (2, 3, 7)
    for bad, words in [
        ("", "at least one step"),
        ("0", "counted from 1"),
        ("7-5", "ends before it starts"),
        ("5-", "not a step or a range"),
        ("a", "not a step or a range"),
        ("5,,6", "not a step or a range"),
        ("-3", "not a step or a range"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_step_ranges(bad)


def test_step_list_option_is_a_config_error_and_an_argparse_error() -> None:
    assert step_list_option(" 5-7 ") == "5-7"
    with pytest.raises(ConfigError, match="ends before"):
        step_list_option("7-5")
    with pytest.raises(argparse.ArgumentTypeError):
        step_list_option("x")
    assert issubclass(StepListError, ConfigError)


def test_profiled_steps_get_a_trace_with_their_matmuls_and_others_none(tmp_path: Path) -> None:
    tables = _train(
        StepProfiler(tmp_path, 0, (2, 3), torch.device("cpu"), row_limit=8), range(1, 5)
    )
    assert tables[1] is None
    assert tables[4] is None
    traces = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert traces == ["rank_0_step_2.json", "rank_0_step_3.json"]
    for step in (2, 3):
        events = _complete_events(tmp_path / "profile" / f"rank_0_step_{step}.json")
        # This step's products only: a shared or leaking session would hold more.
        assert events["aten::mm"] == MATMULS_PER_STEP, events
        assert events[f"hp_train.step_{step}"] == 1
        table = tables[step]
        assert table is not None
        assert f"rank_0_step_{step}.json" in table
        mm_row = next(line for line in table.splitlines() if line.strip().startswith("aten::mm"))
        assert mm_row.split()[-1] == str(MATMULS_PER_STEP)  # the "# of Calls" column


def test_open_step_errors_and_close(tmp_path: Path) -> None:
    profiler = StepProfiler(tmp_path, 0, (1, 2), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without step_begin"):
        profiler.step_end(1)
    profiler.step_begin(1)
    with pytest.raises(RuntimeError, match="step 1 is being profiled"):
        profiler.step_begin(2)
    with pytest.raises(RuntimeError, match="step 1 is being profiled"):
        profiler.step_end(2)
    profiler.close()  # the open session stops; nothing written
    assert not (tmp_path / "profile").exists()
    with pytest.raises(RuntimeError, match="closed"):
        profiler.step_begin(2)


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="1-based"):
        StepProfiler(tmp_path, 0, (0,), cpu)
    with pytest.raises(ValueError, match="1-based"):
        StepProfiler(tmp_path, 0, (), cpu)
    with pytest.raises(ValueError, match="rank"):
        StepProfiler(tmp_path, -1, (1,), cpu)
    with pytest.raises(ValueError, match="row_limit"):
        StepProfiler(tmp_path, 0, (1,), cpu, row_limit=0)
    with pytest.raises(ValueError, match="cannot record device 'meta'"):
        profiler_activities(torch.device("meta"))
    assert profiler_activities(cpu) == (torch.profiler.ProfilerActivity.CPU,)


def test_cli_flags(tmp_path: Path) -> None:
    *_, run, _ = parse(["--out", str(tmp_path), "--profile", "2,4-5", "--steps", "6"], 1)
    assert run.profile_steps == (2, 4, 5)
    assert run.memory_snapshot_steps == ()
    *_, run, _ = parse(["--out", str(tmp_path)], 1)
    assert run.profile_steps == ()
    with pytest.raises(SystemExit):
        parse(["--out", str(tmp_path), "--profile", "4-2"], 1)
    config = tmp_path / "run.toml"
    config.write_text('[run]\nprofile = "2-3"\n')
    *_, run, _ = parse(["--out", str(tmp_path), "--config", str(config)], 1)
    assert run.profile_steps == (2, 3)
    config.write_text('[run]\nprofile = "3-2"\n')
    with pytest.raises(ConfigError, match="ends before it starts"):
        parse(["--out", str(tmp_path), "--config", str(config)], 1)


def _profile_on_rank(out: str) -> dict[str, Any]:
    """One profiled step with a gloo all-reduce of the gradients, on every rank."""
    torch.set_num_threads(1)
    model, optimizer, x = _model()
    profiler = StepProfiler(Path(out), dist.get_rank(), (2,), torch.device("cpu"))
    for step in (1, 2):
        profiler.step_begin(step)
        model(x + dist.get_rank()).sum().backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        profiler.step_end(step)
    profiler.close()
    path = Path(out) / "profile" / f"rank_{dist.get_rank()}_step_2.json"
    return dict(_complete_events(path))


@pytest.mark.multiprocess
def test_a_trace_per_rank(tmp_path: Path) -> None:
    results = run_on_ranks(2, _profile_on_rank, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank_0_step_2.json",
        "rank_1_step_2.json",
    ]
    for events in results:
        assert events["aten::mm"] == MATMULS_PER_STEP
        # The two weight gradients' all-reduces, recorded by the profiler's c10d hooks.
        assert sum(n for name, n in events.items() if "allreduce" in name) >= 2, events
