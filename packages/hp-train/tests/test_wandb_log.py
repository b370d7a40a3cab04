"""Tests for hp_train.observe.wandb_log: offline W&B runs read back from their own files.

Reading back. W&B writes an offline run as ``run-<id>.wandb``: a record log in LevelDB's log
format (a 7-byte file header ``":W&B"``, magic 0xBEE1, version; then 32 KiB blocks of chunks,
each ``crc32 (4, little-endian) | length (2) | type (1) | data``, type 1 a whole record, 2-4
its first, middle and last pieces), each record a ``wandb.proto.wandb_internal_pb2.Record``
(protobuf). :func:`read_records` below decodes that with ``struct``, ``zlib`` and the protobuf
classes only; the scalars are the ``history`` records (one per step: the step and
``key -> JSON value`` items), the config is the ``config`` record.

No network. W&B's client talks to its own service process (``wandb-core``) over a Unix domain
socket, so the ``offline`` fixture of conftest.py (which refuses every ``connect``) cannot be
used as it is. :func:`no_network` refuses name resolution and every connect that is not to a
Unix socket in this process, and points everything the service process could reach out to (the
W&B server address, the HTTP(S) proxies, its cloud metadata address) at a listening socket of
the test that records whatever connects: an attempt from either process fails the test.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError
from hp_train.observe.tensorboard import (
    EVAL_LOSS,
    GRAD_NORM,
    MOE_AUX_LOSS,
    STEP_TIME_S,
    TOKENS_PER_S,
    TRAIN_LOSS,
    lr_tag,
)
from hp_train.observe.wandb_log import (
    MISSING_WANDB,
    RUN_ID_FILE,
    check_wandb_available,
    open_wandb,
)

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7


def read_records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order (checksums verified)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    assert struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records: list[Any] = []
    pos, pieces = 7, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0 and length == 0:
            continue
        assert crc == zlib.crc32(bytes([kind]) + chunk), f"bad checksum at {pos}"
        pieces += chunk
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {tag: value} of the run's history records (W&B's own ``_``-keys left out)."""
    (path,) = run_dir.glob("run-*.wandb")
    rows: dict[int, dict[str, float]] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        step = int(items.pop("_step"))
        rows[step] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def config_of(run_dir: Path) -> dict[str, Any]:
    (path,) = run_dir.glob("run-*.wandb")
    config: dict[str, Any] = {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        # The run record holds the config given to init; config records later changes.
        updates = record.run.config.update if kind == "run" else record.config.update
        for item in updates if kind in ("run", "config") else ():
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No network for this process or W&B's service process (see the module docstring)."""
    attempts: list[object] = []
    connect = socket.socket.connect

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError("no network in hp-train's W&B tests")

    def unix_only(sock: socket.socket, address: Any) -> None:
        if sock.family != socket.AF_UNIX:
            refuse(sock, address)
        connect(sock, address)

    sentinel = socket.create_server(("127.0.0.1", 0))
    sentinel.settimeout(0.1)
    url = f"http://127.0.0.1:{sentinel.getsockname()[1]}"
    done = threading.Event()

    def record_connections() -> None:
        while not done.is_set():
            try:
                conn, _ = sentinel.accept()
            except TimeoutError:
                continue
            conn.settimeout(1.0)
            try:
                attempts.append(("to the sentinel", conn.recv(256)))
            except OSError as exc:
                attempts.append(("to the sentinel", exc))
            conn.close()

    watcher = threading.Thread(target=record_connections, daemon=True)
    watcher.start()
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", unix_only)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, url)
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("no_proxy", "")
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_X_STATS_COREWEAVE_METADATA_BASE_URL", url)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    yield
    done.set()
    watcher.join(timeout=5)
    sentinel.close()
    assert not attempts, f"W&B tried the network: {attempts[:3]}"


def _rows(step: int) -> dict[str, float | None]:
    values: dict[str, float | None] = {
        TRAIN_LOSS: 10.0 / (step + 1),
        lr_tag("muon"): 0.02 * (step + 1),
        lr_tag("adamw"): 3e-4 * (step + 1),
        GRAD_NORM: 1.5 + step,
        TOKENS_PER_S: 12345.6 + step,
        STEP_TIME_S: 0.125 * (step + 1),
        MOE_AUX_LOSS: None,  # a dense model: skipped
    }
    if step == 2:
        values[EVAL_LOSS] = 4.25
        values[GRAD_NORM] = math.inf  # non-finite: skipped, as in TensorBoard
    return values


@pytest.mark.usefixtures("no_network")
def test_scalars_are_read_back_from_the_offline_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = {"training": {"lr": 3e-4, "steps": 4}, "run": {"out": out}}
    with open_wandb(
        out, project="hp-test", run_name="tiny", config=config, resume_step=None
    ) as log:
        for step in range(4):
            log.scalars(step, _rows(step))
    run_dir = log.run_dir
    assert run_dir.parent == out / "wandb"
    assert run_dir.name.startswith("offline-run-")
    assert run_dir.name.endswith(log.run_id)
    expected = {
        step: {
            tag: value
            for tag, value in _rows(step).items()
            if value is not None and math.isfinite(value)
        }
        for step in range(4)
    }
    assert history(run_dir) == expected
    stored = config_of(run_dir)
    assert stored["training"] == {"lr": 3e-4, "steps": 4}
    assert stored["run"] == {"out": str(out)}
    assert stored["resume_step"] == 0
    assert (out / "wandb" / RUN_ID_FILE).read_text().strip() == log.run_id


@pytest.mark.usefixtures("no_network")
def test_a_resumed_run_continues_the_run_id(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with open_wandb(out, project="p", run_name="r", config={}, resume_step=None) as first:
        first.scalars(0, {TRAIN_LOSS: 3.0})
        first.scalars(1, {TRAIN_LOSS: 2.0})
    with open_wandb(out, project="p", run_name="r", config={}, resume_step=1) as resumed:
        resumed.scalars(1, {TRAIN_LOSS: 2.5})
        resumed.scalars(2, {TRAIN_LOSS: 1.0})
    assert resumed.run_id == first.run_id
    assert resumed.run_dir != first.run_dir
    assert history(first.run_dir) == {0: {TRAIN_LOSS: 3.0}, 1: {TRAIN_LOSS: 2.0}}
    assert history(resumed.run_dir) == {1: {TRAIN_LOSS: 2.5}, 2: {TRAIN_LOSS: 1.0}}
    assert config_of(resumed.run_dir)["resume_step"] == 1
    with open_wandb(out, project="p", run_name="r", config={}, resume_step=None) as new:
        pass
    assert new.run_id != first.run_id


@pytest.mark.usefixtures("no_network")
def test_bad_calls_are_named(tmp_path: Path) -> None:
    log = open_wandb(tmp_path, project="p", run_name="r", config={}, resume_step=None)
    with pytest.raises(ValueError, match="unknown W&B tag 'loss'"):
        log.scalars(0, {"loss": 1.0})
    with pytest.raises(TypeError, match="must be a number"):
        log.scalars(0, {TRAIN_LOSS: "1.0"})  # type: ignore[dict-item]
    log.scalars(3, {TRAIN_LOSS: 1.0})
    with pytest.raises(ValueError, match="steps only grow"):
        log.scalars(2, {TRAIN_LOSS: 1.0})
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.scalars(4, {TRAIN_LOSS: 1.0})
    assert history(log.run_dir) == {3: {TRAIN_LOSS: 1.0}}
    with pytest.raises(ValueError, match="project"):
        open_wandb(tmp_path, project="", run_name="r", config={}, resume_step=None)
    with pytest.raises(ValueError, match="resume_step"):
        open_wandb(tmp_path, project="p", run_name="r", config={}, resume_step=-1)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    check_wandb_available()  # installed in the test environment
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'hp-train\[wandb\]'") as caught:
        check_wandb_available()
    assert MISSING_WANDB in str(caught.value)
    with pytest.raises(ConfigError, match=r"hp-train\[wandb\]"):
        open_wandb(tmp_path, project="p", run_name="r", config={}, resume_step=None)
    # The command line refuses it at parse time, before any data is loaded.
    with pytest.raises(ConfigError, match=r"hp-train\[wandb\]"):
        parse(["--out", str(tmp_path), "--wandb"], 1)


def test_cli_flags(tmp_path: Path) -> None:
    *_, run, _ = parse(["--out", str(tmp_path), "--wandb", "--wandb-project", "mine"], 1)
    assert run.wandb
    assert run.wandb_project == "mine"
    *_, run, _ = parse(["--out", str(tmp_path)], 1)
    assert not run.wandb
    assert run.wandb_project == "hp-train"
