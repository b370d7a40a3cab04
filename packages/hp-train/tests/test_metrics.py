"""Tests for hp_train.observe.metrics: JSON Lines round trip, JSON-safe values, peak memory."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hp_train.observe.metrics import (
    MEMORY_LABELS,
    NONFINITE_KEY,
    MetricsWriter,
    memory_key,
    peak_memory_bytes,
    per_rank_memory,
    read_metrics,
    to_json_record,
)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "loss": 3.5, "lr": 3e-4, "phase": "warmup", "done": False, "note": None},
        {"step": 2, "loss": 3.25, "per_layer": {"0": 1.0, "1": 2.0}, "hist": [1, 2, 3]},
    ]
    with MetricsWriter(path) as writer:
        for record in records:
            writer.write(record)
    assert writer.closed
    assert read_metrics(path) == records
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_each_line_is_flushed(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": 2.0})
    # Visible to another reader before close.
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    writer.write({"step": 2})
    assert path.read_text(encoding="utf-8").endswith('{"step": 2}\n')
    writer.close()
    writer.close()  # idempotent


def test_non_finite_values_become_null_and_are_listed(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as writer:
        writer.write(
            {
                "loss": math.nan,
                "grad_norm": math.inf,
                "min": -math.inf,
                "ok": 1.5,
                "nested": {"a": math.nan, "b": [1.0, math.inf]},
                "tensor": torch.tensor(float("nan")),
            }
        )
        writer.write({"step": 2, "loss": 1.0})
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text
    assert "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=_reject)  # strict JSON
    first, second = read_metrics(path)
    assert first == {
        "loss": None,
        "grad_norm": None,
        "min": None,
        "ok": 1.5,
        "nested": {"a": None, "b": [1.0, None]},
        "tensor": None,
        NONFINITE_KEY: {
            "loss": "nan",
            "grad_norm": "inf",
            "min": "-inf",
            "nested.a": "nan",
            "nested.b.1": "inf",
            "tensor": "nan",
        },
    }
    assert NONFINITE_KEY not in second


def _reject(token: str) -> object:
    raise AssertionError(f"non-standard JSON constant {token}")


def test_tensors_become_python_numbers() -> None:
    record = to_json_record(
        {
            "f32": torch.tensor(2.5),
            "bf16": torch.tensor(1.5, dtype=torch.bfloat16),
            "int": torch.tensor(7),
            "shape1": torch.tensor([0.25]),
            "bool": torch.tensor(True),
            "grad": torch.tensor(3.0, requires_grad=True) * 2,
        }
    )
    assert record == {"f32": 2.5, "bf16": 1.5, "int": 7, "shape1": 0.25, "bool": True, "grad": 6.0}
    assert type(record["int"]) is int
    assert type(record["bool"]) is bool


def test_multi_element_tensor_is_rejected_with_its_name(tmp_path: Path) -> None:
    with (
        MetricsWriter(tmp_path / "m.jsonl") as writer,
        pytest.raises(ValueError, match=r"'loss'.*2 elements"),
    ):
        writer.write({"loss": torch.tensor([1.0, 2.0])})
    assert read_metrics(tmp_path / "m.jsonl") == []  # nothing half-written


def test_bad_records() -> None:
    with pytest.raises(ValueError, match="reserved"):
        to_json_record({NONFINITE_KEY: 1})
    with pytest.raises(TypeError, match="keys must be str"):
        to_json_record({1: 2.0})  # type: ignore[dict-item]
    now = datetime.datetime.now()
    with pytest.raises(TypeError, match=r"'when'.*datetime"):
        to_json_record({"when": now})
    with pytest.raises(TypeError, match=r"'nested'.*non-str key"):
        to_json_record({"nested": {1: 2}})


def test_write_after_close(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "m.jsonl")
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 1})


def test_appends_and_repairs_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "m.jsonl"  # parents are created
    with MetricsWriter(path) as writer:
        writer.write({"step": 1})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"step": 2, "lo')  # a crash mid-record
    with MetricsWriter(path) as writer:
        writer.write({"step": 3})
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines == ['{"step": 1}', '{"step": 2, "lo', '{"step": 3}']
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_read_metrics_skips_blank_lines_and_rejects_non_objects(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": 2}\n', encoding="utf-8")
    assert read_metrics(path) == [{"a": 1}, {"b": 2}]
    path.write_text('{"a": 1}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r":2: expected a JSON object, got list"):
        read_metrics(path)


def test_unicode_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"name": "régime \u00e9t\u00e9 \N{SNOWMAN}"})
    assert read_metrics(path) == [{"name": "régime \u00e9t\u00e9 \N{SNOWMAN}"}]


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(sys.platform == "win32", reason="no resource module")
def test_cpu_peak_memory_is_the_process_peak_rss() -> None:
    before = peak_memory_bytes(torch.device("cpu"))
    assert isinstance(before, int)
    assert before > 10 * 2**20  # a Python process with torch loaded uses well over 10 MiB
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory_bytes("cpu")
    assert after is not None
    assert after >= before
    assert after >= big.numel() * 4
    del big


def test_unknown_devices_give_none() -> None:
    assert peak_memory_bytes(torch.device("meta")) is None
    if not torch.cuda.is_available():
        assert peak_memory_bytes(torch.device("cuda")) is None


def test_accelerator_api_is_used_for_the_current_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[torch.device] = []

    def fake_max(device: torch.device) -> int:
        seen.append(device)
        return 4096

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", fake_max)
    assert peak_memory_bytes(torch.device("cuda", 1)) == 4096
    assert seen == [torch.device("cuda", 1)]


def test_device_module_is_found_generically(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SimpleNamespace(is_available=lambda: True, max_memory_allocated=lambda device: 123)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: fake)
    assert peak_memory_bytes(torch.device("xpu")) == 123
    fake.is_available = lambda: False
    assert peak_memory_bytes(torch.device("xpu")) is None
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: SimpleNamespace())
    assert peak_memory_bytes(torch.device("xpu")) is None


def test_the_memory_figure_is_keyed_by_what_it_measures() -> None:
    assert memory_key("cpu") == "peak_rss_bytes"
    assert memory_key(torch.device("cuda", 1)) == "peak_allocated_bytes"
    assert MEMORY_LABELS["peak_rss_bytes"] == "peak RSS"
    assert per_rank_memory({"peak_rss_bytes": [3, None]}) == ("peak_rss_bytes", [3, None])
    # A record of an older run: its unlabelled figure is still read.
    assert per_rank_memory({"peak_memory_bytes": [5]}) == ("peak_memory_bytes", [5])
    assert per_rank_memory({"loss": 1.0}) is None
