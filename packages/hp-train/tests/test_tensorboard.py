"""Tests for hp_train.observe.tensorboard: event files read back by TensorBoard's own reader."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
    EventAccumulator,
)

from hp_train.config.schema import ConfigError
from hp_train.observe.tensorboard import (
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    GRAD_NORM,
    MFU,
    MISSING_TENSORBOARD,
    MOE_AUX_LOSS,
    PEAK_RSS_MIB,
    SCALAR_TAGS,
    STEP_TIME_S,
    TOKENS_PER_S,
    TRAIN_LOSS,
    lr_tag,
    open_tensorboard,
    peak_mib,
)


def read_back(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``log_dir`` as TensorBoard loads it: tag -> [(step, value)]."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def f32(value: float) -> float:
    """What a TensorBoard scalar holds for ``value``: it is stored as a 32-bit float."""
    return float(np.float32(value))


def test_the_tags_are_the_documented_ones() -> None:
    assert set(SCALAR_TAGS) == {
        "train/loss",
        "train/moe_aux_loss",
        "eval/loss",
        "eval/perplexity",
        "optim/grad_norm",
        "perf/tokens_per_s",
        "perf/step_time_s",
        "perf/mfu",
        "memory/peak_rss_mib",
        "memory/peak_allocated_mib",
    }
    assert lr_tag("muon") == "optim/lr/muon"


def test_scalars_are_read_back_with_their_steps(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    expected: dict[str, list[tuple[int, float]]] = {}
    with open_tensorboard(log_dir) as log:
        for step in range(5):
            values: dict[str, float | None] = {
                TRAIN_LOSS: 10.0 / (step + 1),
                lr_tag("muon"): 0.02 * (step + 1) / 5,
                lr_tag("adamw"): 3e-4 * (step + 1) / 5,
                GRAD_NORM: 1.5 + step,
                TOKENS_PER_S: 12345.6 + step,
                STEP_TIME_S: 0.125 * (step + 1),
                PEAK_RSS_MIB: peak_mib([300 * 2**20 + step, None, 512 * 2**20]),
                MFU: 0.25 + step / 100,
                MOE_AUX_LOSS: None,  # a dense model: skipped
            }
            if step % 2 == 0:
                values[EVAL_LOSS] = 9.0 - step
                values[EVAL_PERPLEXITY] = math.exp(9.0 - step)
            log.scalars(step, values)
            for tag, value in values.items():
                if value is not None:
                    expected.setdefault(tag, []).append((step, f32(value)))
        log.scalars(5, {TRAIN_LOSS: math.nan, GRAD_NORM: math.inf, STEP_TIME_S: -math.inf})
        log.scalars(6, {TRAIN_LOSS: 0.5, EVAL_PERPLEXITY: math.inf})
        expected[TRAIN_LOSS].append((6, 0.5))
    assert expected[PEAK_RSS_MIB][0] == (0, 512.0)
    assert read_back(log_dir) == expected


def test_a_resumed_run_purges_the_interrupted_runs_later_steps(tmp_path: Path) -> None:
    with open_tensorboard(tmp_path) as log:
        for step in range(6):
            log.scalars(step, {TRAIN_LOSS: 10.0 + step})
    # Event files are named by the second they were opened in; the resumed one must sort last.
    time.sleep(1.01 - time.time() % 1)
    with open_tensorboard(tmp_path, purge_step=3) as log:
        for step in (3, 4):
            log.scalars(step, {TRAIN_LOSS: 100.0 + step})
    assert len(list(tmp_path.iterdir())) == 2
    assert read_back(tmp_path)[TRAIN_LOSS] == [
        (0, 10.0),
        (1, 11.0),
        (2, 12.0),
        (3, 103.0),
        (4, 104.0),
    ]


def test_without_tensorboard_the_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a machine without the package: torch.utils.tensorboard's `import tensorboard` fails.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        ConfigError, match=r"TensorBoard needs pip install 'hp-train\[tensorboard\]'"
    ):
        open_tensorboard(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
    assert MISSING_TENSORBOARD == "TensorBoard needs pip install 'hp-train[tensorboard]'"


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    log = open_tensorboard(tmp_path)
    with pytest.raises(ValueError, match=r"unknown TensorBoard tag 'loss'.*train/loss"):
        log.scalars(0, {TRAIN_LOSS: 1.0, "loss": 2.0})
    with pytest.raises(ValueError, match="optimizer group"):
        log.scalars(0, {"optim/lr/": 1.0})
    with pytest.raises(ValueError, match="optimizer group"):
        log.scalars(0, {"optim/lr/a/b": 1.0})
    with pytest.raises(ValueError, match="step"):
        log.scalars(-1, {TRAIN_LOSS: 1.0})
    with pytest.raises(ValueError, match="step"):
        log.scalars(True, {TRAIN_LOSS: 1.0})
    with pytest.raises(TypeError, match="train/loss"):
        log.scalars(0, {TRAIN_LOSS: "1.0"})  # type: ignore[dict-item]
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.scalars(1, {TRAIN_LOSS: 1.0})
    assert read_back(tmp_path) == {}
    with pytest.raises(ValueError, match="purge_step"):
        open_tensorboard(tmp_path, purge_step=-1)


def test_lr_tag_and_peak_mib() -> None:
    with pytest.raises(ValueError, match="group"):
        lr_tag("")
    with pytest.raises(ValueError, match="group"):
        lr_tag("a/b")
    assert peak_mib([None, None]) is None
    assert peak_mib([]) is None
    assert peak_mib([2**20, 3 * 2**19]) == 1.5
