"""The command line's papercuts (issue 45, 6): ``--tensorboard`` without its package is refused
at parse time, ``--help`` shows the defaults, and a usage error under torchrun is printed once
for the job."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hp_train.config import cli
from hp_train.config.cli import EXIT_CONFIG, main, parse_args
from hp_train.config.schema import ParallelConfig, TrainConfig
from hp_train.dryrun.cli import build_parser as dryrun_parser


def _default(cls: type[Any], name: str) -> object:
    (found,) = [f.default for f in dataclasses.fields(cls) if f.name == name]
    return found


# ---------------------------------------------------------------------------- --tensorboard
def test_tensorboard_without_the_package_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the error is logged into the default --out folder
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed

    def no_runtime(*args: object, **kwargs: object) -> None:
        raise AssertionError("the runtime (and the data after it) started")

    monkeypatch.setattr(cli, "init_runtime", no_runtime)
    assert main(["--tensorboard", "--steps", "2"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("hp-train: --tensorboard:")
    assert "pip install 'hp-train[tensorboard]'" in err[0]


def test_tensorboard_with_the_package_parses() -> None:
    pytest.importorskip("tensorboard")
    assert parse_args(["--tensorboard"]).tensorboard is True


# ---------------------------------------------------------------------------------- --help
@pytest.mark.parametrize(
    ("flag", "owner", "field"),
    [
        ("--lr", TrainConfig, "lr"),
        ("--steps", TrainConfig, "steps"),
        ("--pp-schedule", TrainConfig, "pp_schedule"),
        ("--divergence-threshold", TrainConfig, "divergence_threshold"),
        ("--dp-replicate", ParallelConfig, "dp_replicate"),
        ("--cp-variant", ParallelConfig, "cp_variant"),
        ("--seed", TrainConfig, "seed"),  # 0, which equals False
        ("--clip-grad-norm", TrainConfig, "clip_grad_norm"),  # 0.0
    ],
)
def test_help_shows_the_defaults(
    capsys: pytest.CaptureFixture[str], flag: str, owner: type[Any], field: str
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    start = text.index(f" {flag} ")
    entry = text[start : text.index(" --", start + len(flag) + 2)]
    assert f"(default: {_default(owner, field)})" in entry, entry


def test_help_shows_defaults_of_options_without_help_text_and_of_the_dry_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device {cpu,cuda,npu} (default: cpu)" in text
    assert "--out OUT (default: hp_train_out)" in text
    assert "--resume (default" not in text  # a flag that is off unless given
    with pytest.raises(SystemExit):
        dryrun_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--top TOP configurations the search prints (default: 5)" in text
    assert f"(default: {_default(TrainConfig, 'grad_accum')})" in text


# --------------------------------------------------------------------- usage errors per rank
@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("1", False), (None, True)])
def test_a_usage_error_is_printed_by_rank_0_only(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rank: str | None,
    printed: bool,
) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # no torchrun store to wait on
    with pytest.raises(SystemExit) as info:
        parse_args(["--pp-schedule", "zigzag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    if printed:
        assert "hp-train: error: argument --pp-schedule: invalid choice: 'zigzag'" in err
        assert err.startswith("usage: hp-train")
    else:
        assert err == ""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert bool(capsys.readouterr().out) is printed


#: A job's entry point whose rank 0 reaches the parser 3 s after the others (a slow import):
#: the other ranks must not exit, and so make torchrun stop rank 0, before it has printed.
_SLOW_RANK_0 = """
import os, sys, time
if os.environ["RANK"] == "0":
    time.sleep(3)
from hp_train.config.cli import main
sys.exit(main())
"""


@pytest.mark.multiprocess
def test_a_usage_error_under_torchrun_is_printed_once(tmp_path: Path) -> None:
    """Two ranks under torchrun, rank 0 the slower: one usage line and one error line in the
    job's output, and torchrun reports the failure."""
    script = tmp_path / "slow_rank_0.py"
    script.write_text(_SLOW_RANK_0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), "--pp-schedule", "zigzag", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert output.count("hp-train: error: argument --pp-schedule") == 1, output
    assert output.count("usage: hp-train") == 1, output
