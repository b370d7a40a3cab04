"""Tests for hp_train.observe.step_line and .run_header: the step line, the header block, the
end and stop lines (pure formatting; expected strings written out by hand)."""

from __future__ import annotations

import hashlib
import math

from hp_train.observe.run_header import (
    RunFacts,
    command_line,
    config_hash,
    end_line,
    header_lines,
    stop_line,
)
from hp_train.observe.step_line import StepFigures, format_number, step_line


def test_a_step_line_has_every_field_labelled() -> None:
    figures = StepFigures(
        step=20,
        total=40,
        loss=3.21094,
        lr={"muon": 1.2e-3, "adamw": 3e-4},
        grad_norm=0.8123,
        tokens_per_s=12345.0,
        step_time_s=0.0852,
        mfu=0.1234,
        memory=("peak RSS", 350 * 2**20),
    )
    assert step_line(figures) == (
        "step 20/40 | loss 3.2109 | lr muon 1.2e-3 adamw 3e-4 | grad norm 0.812 | "
        "tokens/s 1.23e4 | step 85.2 ms | MFU 12.3% | peak RSS 350 MiB"
    )


def test_missing_figures_say_so() -> None:
    figures = StepFigures(
        step=1,
        total=7,
        loss=5.5,
        lr={"adamw": 0.001},
        grad_norm=None,
        tokens_per_s=512.0,
        step_time_s=1.5,
        mfu=None,
        memory=None,
        extra={"aux loss": 0.0125},
    )
    assert step_line(figures) == (
        "step 1/7 | loss 5.5000 | lr adamw 1e-3 | tokens/s 512 | step 1500 ms | "
        "MFU n/a (pass --peak-tflops) | memory n/a | aux loss 0.0125"
    )


def test_numbers() -> None:
    assert [format_number(v) for v in (0.0, 0.5, 85.24, 350.4, 4138.0, 12345.0, 3e-4)] == [
        "0",
        "0.5",
        "85.2",
        "350",
        "4138",
        "1.23e4",
        "3e-4",
    ]
    assert [format_number(v) for v in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]


def test_the_header_names_what_ran() -> None:
    facts = RunFacts(
        version="0.1.0",
        command="python -m hp_train --steps 7",
        config_hash="0123456789ab",
        world_size=4,
        rank=1,
        mesh={"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1},
        device="cpu",
        flops_per_token=638976,
        seq_len=32,
        peak_flops=1.66e11,
        peak_how="estimated: 1 thread(s) x 2.60 GHz x 64 fp32 FLOP/cycle",
    )
    assert header_lines(facts) == [
        "==== hp-train 0.1.0: run begins ====",
        "command: python -m hp_train --steps 7",
        "configuration: sha256 0123456789ab (of hp_train_config.json's fields)",
        "world: 4 ranks, this one rank 1; mesh dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 x pp 1",
        "device: cpu",
        "model FLOPs: 6.39e+05 per token (forward + backward, seq_len 32)",
        "peak FLOP/s per rank: 0.166 TFLOP/s (estimated: 1 thread(s) x 2.60 GHz x 64 fp32 "
        "FLOP/cycle)",
    ]


def test_config_hash_and_command_line() -> None:
    record = {"model": {"dim": 64}, "training": {"steps": 7, "lr": 3e-3}}
    same_reordered = {"training": {"lr": 3e-3, "steps": 7}, "model": {"dim": 64}}
    expected = hashlib.sha256(
        b'{"model":{"dim":64},"training":{"lr":0.003,"steps":7}}'
    ).hexdigest()[:12]
    assert config_hash(record) == config_hash(same_reordered) == expected
    assert config_hash({**record, "model": {"dim": 32}}) != expected
    main = "/venv/lib/python3.11/site-packages/hp_train/__main__.py"
    assert command_line([main, "--steps", "7", "--data", "my file.jsonl"]) == (
        "python -m hp_train --steps 7 --data 'my file.jsonl'"
    )
    assert command_line(["pytest", "-q"]) == "pytest -q"


def test_end_and_stop_lines() -> None:
    assert end_line("7 steps") == "==== run ends: 7 steps ===="
    error = ValueError("bad\nthing")
    assert stop_line(error, 3) == "==== run stopped: ValueError: bad / thing (during step 3) ===="
    assert stop_line(KeyboardInterrupt(), None) == "==== run stopped: KeyboardInterrupt ===="
