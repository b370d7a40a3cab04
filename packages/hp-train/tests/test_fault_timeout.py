"""A rank that never joins a collective: the whole job exits non-zero at the timeout.

``torchrun ... -m hp_train`` at world 2 (tp 2, and FSDP 2), launched as a user would, with a
3 s collective timeout (``HP_TRAIN_COLLECTIVE_TIMEOUT``) and ``HP_TRAIN_INJECT_STALL=1:1``:
rank 1 stops for good before its first watched collective. Rank 0 must raise
:class:`hp_dtensor.watchdog.CollectiveTimeoutError` naming the collective, its group and rank
1; torchrun then stops rank 1, and the launcher exits non-zero, within the timeout and a
margin of the stall (without the timeout reaching every group the job hung for 30 minutes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from hp_train.runtime import STALL_ENV, TIMEOUT_ENV
from test_faults import FAULTS, _pattern

TIMEOUT_S = 3
# From the stalled rank's notice to the launcher's exit: the timeout, then rank 0's diagnosis
# and exit, torchrun noticing it (it polls every 0.1 s) and stopping rank 1 (SIGTERM). Seconds,
# measured at about 1.5 on an idle machine; loaded CI machines are slower.
MARGIN_S = 8.0
# The whole job, most of it importing torch into three processes.
LAUNCH_DEADLINE_S = 240
ARGS = [
    "--steps", "1", "--data", "synthetic", "--global-batch", "2", "--seq-len",
    "8", "--quiet", "--threads", "1",
]  # fmt: skip
# Where rank 1 stalls: inside the model (the first tensor-parallel collective of the forward)
# and at the step's end (under FSDP the first watched collective is the loss all-reduce).
CASES = {
    "tp2, inside the forward": (
        ["--tp", "2"],
        {"group": "'world' (axis 'tp') (ranks [0, 1])"},
    ),
    "fsdp2, the step's loss": (
        ["--dp-shard", "2"],
        {"collective": "all_reduce (step loss)"},
    ),
}
# torchrun's failure summary: one entry per rank.
_EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env[TIMEOUT_ENV] = str(TIMEOUT_S)
    env[STALL_ENV] = "1:1"
    return env


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_that_never_joins_fails_the_job_in_time(
    case: str, tmp_path: os.PathLike[str]
) -> None:
    extra, values = CASES[case]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
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
    error = re.search(r"\[rank0\]: hp_dtensor\.watchdog\.CollectiveTimeoutError: (.*)", output)
    assert error is not None, output[-3000:]
    expected = _pattern(FAULTS["stall"].message, {**values, "timeout": TIMEOUT_S})
    assert re.match(expected.replace(".*?", ".*") + "$", error.group(1)), error.group(1)
    assert re.search(r": rank 1 of the group did not arrive$", error.group(1)), error.group(1)
    # Every rank exited non-zero: rank 0 with the error, rank 1 stopped by torchrun.
    codes = {int(rank): int(code) for rank, code in _EXIT.findall(output)}
    assert sorted(codes) == [0, 1], output[-3000:]
    assert all(code != 0 for code in codes.values()), codes
