"""An error the user can fix is reported once for the job, before any rank exits
(``hp_train.observe.errors.report_error``), and as one line when the run is a torchrun job."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

# Public as torch.distributed.FileStore and .Store; torch's stubs only export them here.
from torch._C._distributed_c10d import FileStore, Store

from hp_testing import run_on_ranks
from hp_train.observe.errors import report_error


class _Console(io.StringIO):
    """A console that takes ``delay_s`` to write and notes when its last write ended."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.done = 0.0

    def write(self, text: str) -> int:
        time.sleep(self.delay_s)
        written = super().write(text)
        self.done = time.time()
        return written


def _report(path: str, arrive: list[float], messages: list[str], delay_s: float) -> dict[str, Any]:
    rank = dist.get_rank()
    store = FileStore(path, 2)
    time.sleep(arrive[rank])
    console = _Console(delay_s)
    report_error(messages[rank], job=(store, rank, 2), grace_s=0.5, wait_s=10.0, stream=console)
    return {"out": console.getvalue(), "printed": console.done, "returned": time.time()}


@pytest.mark.multiprocess
def test_no_rank_returns_before_the_message_is_printed(tmp_path: Path) -> None:
    """Rank 0 reports first and, alone after its grace period, prints, slowly; rank 1 reports
    after that and must not return (exit) before rank 0's line is out."""
    path = str(tmp_path / "store")
    results = run_on_ranks(2, _report, path, [0.0, 1.0], ["no such file", "no such file"], 1.0)
    assert results[0]["out"] == "hp-train: no such file\n"
    assert results[1]["out"] == ""
    assert results[1]["returned"] >= results[0]["printed"]


@pytest.mark.multiprocess
def test_one_line_per_distinct_message_naming_its_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    results = run_on_ranks(2, _report, path, [0.0, 0.0], ["bad data", "bad out"], 0.0)
    printed = [r["out"] for r in results if r["out"]]
    assert printed == ["hp-train: bad data (rank 0)\nhp-train: bad out (rank 1)\n"]


@pytest.mark.multiprocess
def test_the_same_message_from_every_rank_is_one_line(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    results = run_on_ranks(2, _report, path, [0.0, 0.0], ["tp=3 ...", "tp=3 ..."], 0.0)
    assert sorted(r["out"] for r in results) == ["", "hp-train: tp=3 ...\n"]


class _ClaimedStore(Store):
    """A one-process store where another rank has claimed the printing and never prints."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount + (1 if key.endswith("/printer") else 0)
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if not self.check(keys):
            raise dist.DistStoreError(f"timed out waiting for {keys}")


def test_a_rank_prints_its_own_line_when_the_printer_is_gone() -> None:
    console = io.StringIO()
    report_error("bad --out", job=(_ClaimedStore(), 1, 2), grace_s=0.0, wait_s=0.1, stream=console)
    assert console.getvalue() == "hp-train: bad --out (rank 1)\n"


def test_one_process_prints_at_once() -> None:
    console = io.StringIO()
    report_error("bad --steps", job=None, stream=console)
    assert console.getvalue() == "hp-train: bad --steps\n"


def _torchrun(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``python -m hp_train`` at world 2 on synthetic data, ``flags`` added (the tiny model
    unless ``--init-from`` gives one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    model = [] if "--init-from" in flags else ["--model", "tiny"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hp_train", *model, "--steps", "2", "--data", "synthetic",
        "--out", str(tmp_path / "out"), *flags,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The job's one ``hp-train:`` line; torchrun exits 1 for any failed rank, the ranks' own
    code 2 is in its report."""
    lines = [line for line in done.stderr.splitlines() if line.startswith("hp-train:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert "(exitcode: 2)" in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


@pytest.mark.multiprocess
def test_a_missing_checkpoint_folder_is_one_line_and_in_every_log(tmp_path: Path) -> None:
    """``--resume-from`` a folder that does not exist, at world 2: every rank finds it; the job
    says so once on the console and in every rank's log, and the ranks exit 2."""
    missing = tmp_path / "nowhere"
    done = _torchrun(tmp_path, "--resume-from", str(missing))
    assert _one_line(done) == f"hp-train: --resume-from {missing}: no such checkpoint directory"
    assert done.stderr.count(f"{missing}: no such") == 1, done.stderr[-3000:]
    for rank in (0, 1):
        log = (tmp_path / "out" / "logs" / f"rank_{rank}.log").read_text()
        assert f"rank {rank} ERROR hp_train.errors: --resume-from {missing}" in log


@pytest.mark.multiprocess
def test_degrees_that_do_not_fill_the_world_name_the_mesh(tmp_path: Path) -> None:
    """``--dp-shard 3`` at world 2 names the ranks and the degrees (it named the global batch)."""
    line = _one_line(_torchrun(tmp_path, "--dp-shard", "3"))
    assert line.startswith("hp-train: the job has 2 ranks but dp_replicate x dp_shard x cp"), line


@pytest.mark.multiprocess
def test_weights_that_do_not_match_their_config_are_an_input_error(tmp_path: Path) -> None:
    """``--init-from`` a Hugging Face folder whose ``config.json`` says a wider feed-forward
    than its weights hold: one line naming the tensor, exit 2 (it was a traceback per rank,
    exit 1)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    settings = json.loads((folder / "config.json").read_text())
    settings["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(settings))
    line = _one_line(_torchrun(tmp_path, "--init-from", str(folder), "--seq-len", "16"))
    assert "mlp" in line, line
    assert "96" in line or "64" in line, line


@pytest.mark.multiprocess
def test_an_output_folder_that_cannot_be_written_is_an_input_error(tmp_path: Path) -> None:
    """``--out`` below a regular file (as a read-only folder, and as root can still write
    read-only folders): every rank finds it before writing anything; one line, exit 2 (it was
    an ``OSError`` traceback on every rank, or broken connections on ranks 1-3)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    out = blocker / "run"
    line = _one_line(_torchrun(tmp_path, "--out", str(out)))
    assert line.startswith(f"hp-train: --out {out}: cannot write there ("), line
    assert line.endswith("choose a folder this job can create and write"), line


def _binary(path: Path) -> Path:
    path.write_bytes(bytes(range(256)) * 64)
    return path


@pytest.mark.multiprocess
def test_a_binary_data_file_is_an_input_error(tmp_path: Path) -> None:
    """``--data`` a binary ``.txt``: one line naming the file, what the reader found and what
    the file must hold; exit 2 (it was a ``datasets`` traceback on every rank, exit 1)."""
    data = _binary(tmp_path / "notes.txt")
    line = _one_line(_torchrun(tmp_path, "--data", str(data)))
    assert line.startswith(f"hp-train: --data {data}: cannot read it as text files ("), line
    assert "UnicodeDecodeError" in line, line
    assert line.endswith("each file must hold UTF-8 text"), line


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("name", "kind", "holds"),
    [
        ("a.txt", "text", "UTF-8 text"),
        ("a.jsonl", "json", "JSON Lines"),
        ("a.parquet", "parquet", "a Parquet table"),
    ],
)
def test_each_kind_of_unreadable_file_is_named(
    tmp_path: Path, name: str, kind: str, holds: str, streaming: bool
) -> None:
    from hp_train.config.schema import ConfigError
    from hp_train.data.loader import DataSpec, build_data
    from hp_train.data.tokenizer import ByteTokenizer

    data = _binary(tmp_path / name)

    def first_batch() -> None:
        spec = DataSpec(str(data), streaming=streaming)
        build_data(spec, ByteTokenizer(), seq_len=16, seed=0).batch(0, 4, 0, 1)

    with pytest.raises(ConfigError) as raised:
        first_batch()
    text = str(raised.value)
    assert text.startswith(f"--data {data}: cannot read it as {kind} files ("), text
    assert holds in text, text


def _lock(out: Path, pid: int, host: str | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {"host": host or socket.gethostname(), "pid": pid, "started": "2026-12-05T00:00:00+00:00"}
    )
    (out / "run.lock").write_text(text)
    return text


@pytest.mark.multiprocess
def test_a_folder_another_live_run_holds_is_refused_naming_it(tmp_path: Path) -> None:
    """Two runs on one ``--out``: the second is refused, naming the first (its pid and host),
    and writes nothing there, not even its logs (both used to exit 0, one run's metrics and
    checkpoints gone)."""
    out = tmp_path / "out"
    held = _lock(out, os.getpid())  # this test's process: alive
    line = _one_line(_torchrun(tmp_path))
    assert line.startswith(
        f"hp-train: --out {out} is in use by another run (pid {os.getpid()} on"
    ), line
    assert "which is still running" in line, line
    assert (out / "run.lock").read_text() == held
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]


@pytest.mark.multiprocess
def test_a_lock_whose_run_is_gone_is_taken_over_and_released(tmp_path: Path) -> None:
    out = tmp_path / "out"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(gone.stdout)
    _lock(out, pid)
    done = _torchrun(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"hp-train: warning: --out {out}: took over the lock of a run that is gone (pid {pid} on"
        in done.stderr
    )
    assert not (out / "run.lock").exists()


def test_a_lock_held_on_another_host_is_refused() -> None:
    from hp_train.observe.out_dir import OutDirInUseError, claim_out_dir

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        _lock(out, 1, host="elsewhere.invalid")
        with pytest.raises(OutDirInUseError, match="runs on another host"):
            claim_out_dir(out)


def test_an_unavailable_device_is_an_input_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device cuda`` where there is no CUDA: one line naming the device, exit 2 (it was an
    ``AttributeError`` traceback from torch)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from hp_train.config.cli import main

    assert main(["--device", "cuda", "--steps", "1", "--data", "synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hp-train: device type 'cuda' is not available"), err
    assert len(err.splitlines()) == 1
