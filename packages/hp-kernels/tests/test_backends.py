"""Backend selection: forced reference, one-warning fallback, a package without the extension."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hp_kernels
from _util import bit_equal
from hp_kernels import backends, flat_buffer


@pytest.fixture
def fresh_warnings() -> None:
    backends.reset_warnings()


def test_available_backends_reports_every_device_type() -> None:
    found = hp_kernels.available_backends()
    assert set(found) == {"cpu", "cuda", "npu"}
    for device_type, what in found.items():
        assert what in {"cpp-extension", "triton", "torch_npu"} or what.startswith("reference ("), (
            device_type,
            what,
        )


def test_force_reference_env(monkeypatch: pytest.MonkeyPatch, fresh_warnings: None) -> None:
    called: list[str] = []
    monkeypatch.setitem(
        flat_buffer._PACK,
        "cpu",
        backends.Native("spy", lambda: None, lambda *a: called.append("native")),
    )
    t = torch.randn(10)
    out = torch.empty(10, dtype=torch.bfloat16)
    monkeypatch.setenv(backends.FORCE_REFERENCE_ENV, "1")
    hp_kernels.pack([t], out, [0])
    assert called == []
    assert bit_equal(out, t.bfloat16())
    assert all(v.startswith("reference (") for v in hp_kernels.available_backends().values())
    monkeypatch.setenv(backends.FORCE_REFERENCE_ENV, "0")
    hp_kernels.pack([t], out, [0])
    assert called == ["native"]


def test_missing_backend_warns_once_per_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None
) -> None:
    # Simulate an install whose extension could not be built.
    monkeypatch.setattr(backends, "load_cpu_extension", lambda: "simulated: not built")
    monkeypatch.delenv(backends.FORCE_REFERENCE_ENV, raising=False)
    t = torch.randn(3, 10)
    with caplog.at_level(logging.WARNING, logger="hp_kernels"):
        for _ in range(3):
            out = hp_kernels.pack([t], torch.empty(30, dtype=torch.bfloat16), [0])
            hp_kernels.unpack(out, [0], [torch.empty(3, 10)])
            hp_kernels.newton_schulz(t, dtype=torch.bfloat16)
    messages = [r.getMessage() for r in caplog.records if r.name == "hp_kernels"]
    assert len(messages) == 3, messages
    for op in ("pack", "unpack", "newton_schulz"):
        assert any(
            m.startswith(f"hp_kernels.{op} on cpu: cpp-extension unavailable (simulated")
            for m in messages
        ), messages
    assert hp_kernels.available_backends()["cpu"] == "reference (simulated: not built)"


_SCRIPT = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import hp_kernels
from hp_kernels import reference
ts = [torch.randn(1000, 3), torch.randn(0), torch.randn(77).bfloat16()]
offsets, size = hp_kernels.offsets_of(ts)
got = hp_kernels.pack(ts, torch.empty(size, dtype=torch.bfloat16), offsets)
hp_kernels.pack(ts, torch.empty(size, dtype=torch.bfloat16), offsets)
want = torch.empty(size, dtype=torch.bfloat16)
reference.pack(ts, want, offsets)
x = torch.randn(2, 8, 5)
ns = hp_kernels.newton_schulz(x, dtype=torch.bfloat16)
print(json.dumps({
    "backends": hp_kernels.available_backends(),
    "pack_equal": torch.equal(got.view(torch.int16), want.view(torch.int16)),
    "ns_shape": list(ns.shape),
    "file": hp_kernels.__file__,
}))
"""


def _run(env_extra: dict[str, str], pythonpath: str | None = None) -> tuple[dict[str, object], str]:
    env = {**os.environ, **env_extra}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, proc.stderr


def test_forced_reference_in_a_fresh_process() -> None:
    result, stderr = _run({backends.FORCE_REFERENCE_ENV: "1"})
    assert result["pack_equal"] is True
    assert result["ns_shape"] == [2, 8, 5]
    assert "running the PyTorch reference" not in stderr  # forcing is not a fallback


def test_package_without_extension_works_and_warns_once(tmp_path: Path) -> None:
    # What an install without the compiled extension looks like: the Python files only.
    src = Path(hp_kernels.__file__).resolve().parent
    dst = tmp_path / "hp_kernels"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("_cpu_ops*", "__pycache__", "float8"))
    pythonpath = os.pathsep.join([str(tmp_path), *sys.path[1:]])
    result, stderr = _run({backends.FORCE_REFERENCE_ENV: "0"}, pythonpath=pythonpath)
    assert Path(str(result["file"])).resolve().is_relative_to(tmp_path.resolve())
    assert result["pack_equal"] is True
    backends_found = result["backends"]
    assert isinstance(backends_found, dict)
    assert str(backends_found["cpu"]).startswith("reference (the CPU extension was not built")
    warnings = [line for line in stderr.splitlines() if "hp_kernels.pack on cpu" in line]
    assert len(warnings) == 1, stderr
