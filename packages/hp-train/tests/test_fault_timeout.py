"""A rank that never joins a collective: the whole job exits non-zero at the timeout.

``torchrun ... -m hp_train`` at world 2 (FSDP 2) and 4 (FSDP 2 x tp 2), launched as a
user would, with a 3 s collective timeout (``HP_TRAIN_COLLECTIVE_TIMEOUT``) and
``HP_TRAIN_INJECT_STALL=1:2``: rank 1 stops for good before its second watched collective (the
first is the output folder's claim).
Every other rank must raise :class:`hp_dtensor.watchdog.CollectiveTimeoutError` naming the
collective, its group and the rank it waits for, printed as ``hp-train: <diagnosis>`` (exit
code 5); torchrun then stops rank 1, and the launcher
exits non-zero, within the timeout and a margin of the stall (without the timeout reaching
every group the job hung for 30 minutes).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from hp_dtensor.collective_errors import CollectiveTimeoutError
from hp_train.config import cli
from hp_train.runtime import STALL_ENV, TIMEOUT_ENV
from test_faults import FAULTS, _pattern

TIMEOUT_S = 3
# From the stalled rank's notice to the launcher's exit: the timeout, then rank 0's diagnosis
# and exit, torchrun noticing it (it polls every MONITOR_S) and stopping rank 1 (SIGTERM).
# Seconds, measured at about 1.5 on an idle machine (0.1 s polls); loaded CI machines are slower.
MARGIN_S = 8.0
# torchrun's poll interval. At its 0.1 s default, the first waiting rank to exit (code 5) gets
# the others stopped before every one has printed its diagnosis (seen once at world 4 in CI):
# they time out together but print a few milliseconds apart. 1 s lets each print; the
# launcher's exit is still inside the margin.
MONITOR_S = 1
# The whole job, most of it importing torch into three processes.
LAUNCH_DEADLINE_S = 240
ARGS = [
    "--steps", "1", "--data", "synthetic", "--global-batch", "2", "--seq-len",
    "8", "--quiet", "--threads", "1",
]  # fmt: skip
# Where rank 1 stalls: at world 2 under FSDP, at the step's loss all-reduce (its second
# watched synchronous collective); at world 4 inside the model (the first tensor-parallel
# collective of the forward). Each case: (world, extra flags, the first waiting rank's
# expected message parts). At world 4 (dp_shard 2 x tp 2) rank 0 waits in the tp group and
# ranks 2 and 3 in FSDP's parameter all-gathers over dp_shard: rank 2's missing peer is rank
# 0 (itself waiting for rank 1), rank 3's is rank 1.
CASES = {
    "fsdp2, the step's loss": (
        2,
        ["--dp-shard", "2"],
        {"collective": "all_reduce (step loss)", "missing": 1},
    ),
    "fsdp2 x tp2, world 4": (
        4,
        ["--dp-shard", "2", "--tp", "2", "--global-batch", "4"],
        {"group": "'tp' (ranks [0, 1])", "missing": 1},
    ),
}
# torchrun's failure summary: one entry per rank.
_EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env[TIMEOUT_ENV] = str(TIMEOUT_S)
    env[STALL_ENV] = "1:2"
    return env


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_that_never_joins_fails_the_job_in_time(
    case: str, tmp_path: os.PathLike[str]
) -> None:
    world, extra, values = CASES[case]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        f"--monitor-interval={MONITOR_S}",
        "-m", "hp_train", *ARGS, *extra, "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        lines.extend((time.monotonic(), line) for line in proc.stdout)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=LAUNCH_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the job hung: " + "".join(line for _, line in lines)[-3000:])
    ended = time.monotonic()
    reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    assert proc.returncode != 0, output[-3000:]
    stalled = [t for t, line in lines if f"{STALL_ENV}: rank 1 stalls" in line]
    assert stalled, output[-3000:]
    assert ended - stalled[0] <= TIMEOUT_S + MARGIN_S, (ended - stalled[0], output[-3000:])
    # Rank 0 names the collective, the group and the rank that did not arrive.
    # (printed by hp_train's main as one `hp-train: <diagnosis>` per rank, exit code 5).
    # The rank is in the diagnosis itself: "(rank <r>, its collective #<n> ...".
    diagnosis = r"^hp-train: (.* did not complete within .*? \(rank (\d+), .*)$"
    found = re.findall(diagnosis, output, re.MULTILINE)
    errors = {rank: message for message, rank in found}
    # Every rank but the stalled one raised it; rank 0 names the collective, the group and
    # the rank that did not arrive.
    assert sorted(errors) == [str(r) for r in range(world) if r != 1], output[-3000:]
    expected = _pattern(FAULTS["stall"].message, {**values, "timeout": TIMEOUT_S})
    assert re.match(expected.replace(".*?", ".*") + "$", errors["0"]), errors["0"]
    if world == 4:
        assert "over group 'dp_shard' (ranks [0, 2])" in errors["2"], errors["2"]
        assert errors["2"].endswith("rank 0 of the group did not arrive"), errors["2"]
        assert "over group 'dp_shard' (ranks [1, 3])" in errors["3"], errors["3"]
        assert errors["3"].endswith("rank 1 of the group did not arrive"), errors["3"]
    # Every rank exited non-zero: the others with the error, rank 1 stopped by torchrun.
    codes = {int(rank): int(code) for rank, code in _EXIT.findall(output)}
    assert sorted(codes) == list(range(world)), output[-3000:]
    assert all(code != 0 for code in codes.values()), codes
    # The first to leave is a waiting rank, with the collective-failure exit code.
    assert "(exitcode: 5)" in output, output[-3000:]


def test_an_unknown_device_type_is_named_before_anything_starts() -> None:
    """The runtime takes its backend from hp-dtensor's one table: an unknown device type is a
    ValueError naming the types there are, raised before any process group or device is set."""
    from hp_train.runtime import init_runtime

    with pytest.raises(ValueError, match=re.escape("use one of ['cpu', 'cuda', 'npu']")):
        init_runtime("tpu")


class _Writes(io.RawIOBase):
    """A console's file descriptor: keeps each write it is given, as the pipe would see it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.writes.append(bytes(data))
        return len(data)


def test_a_diagnosis_reaches_the_shared_console_in_one_write(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    """Ranks that time out together print together into torchrun's one console: a diagnosis
    (several lines) and its last newline must leave in one write, or another rank's line can
    land between them and no longer begin a line (the world-4 case above once lost rank 0's
    diagnosis that way). The console is line-buffered, as Python's stderr is on a pipe."""
    message = (
        "all_reduce over group 'tp' (ranks [0, 1]) did not complete within the 3 s timeout "
        "(rank 0, its collective #1 over this group, failed after 3.0 s): rank 1 of the group "
        "did not arrive\n  rank 1: no report\n  backend error: Timed out waiting 3000ms"
    )

    def fail(*args: object, **kwargs: object) -> None:
        raise CollectiveTimeoutError(
            message, collective="all_reduce", group="'tp' (ranks [0, 1])", ranks=(0, 1),
            missing=(1,), timeout_s=3.0, elapsed_s=3.0,
        )  # fmt: skip

    raw = _Writes()
    console = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=True)
    monkeypatch.setattr(cli, "train", fail)
    monkeypatch.setattr(sys, "stderr", console)
    assert cli.main([*ARGS, "--out", str(tmp_path)]) == cli.EXIT_COLLECTIVE
    assert raw.writes == [f"hp-train: {message}\n".encode()]
