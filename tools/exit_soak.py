"""Run many small ``torchrun ... -m hp_train`` jobs one after another and count how they exit.

A soak test for the teardown of a job, not a CI test: a rank that aborts at interpreter exit
(``terminate called without an active exception``, SIGABRT) after correct work makes torchrun
exit 1 in a few percent of the jobs only, so it takes tens or hundreds of jobs to see it.

The jobs cycle through the kinds the test suite launches (world 2, the tiny model, synthetic
data, CPU):

* ``train``: two steps with a checkpoint; every rank exits 0 and so does torchrun.
* ``resume``: ``--resume`` from the previous ``train`` job's checkpoint, one more step; exit 0.
* ``config``: ``--dp-shard 3`` at world 2, a configuration error found after the process group
  exists; every rank exits 2 (torchrun 1).
* ``nonfinite``: ``--lr 1e6`` with AdamW stops on a non-finite value; every rank exits 3
  (torchrun 1).

A job is *clean* when torchrun's exit code is the expected one, every rank exit code torchrun
reports is the expected one (or SIGTERM, torchrun stopping a rank after another failed) and
no rank printed ``terminate called``. Each failure's last stderr lines are printed and its
whole stderr saved. Run it from the repository root, in the environment that has the packages::

    python tools/exit_soak.py --jobs 200 --work /tmp/exit_soak

``--pythonpath`` puts folders before the installed packages (to soak a patched copy).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: Every job: world 2, the tiny model on synthetic data, one thread per rank, no console noise.
BASE = [
    "--model", "tiny", "--data", "synthetic", "--global-batch", "2", "--seq-len", "8",
    "--quiet", "--threads", "1",
]  # fmt: skip

#: torchrun's failure summary, one entry per failed rank.
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
#: What libstdc++ prints on std::terminate (a joinable std::thread destroyed, a forced unwind
#: through a noexcept frame, ...).
_TERMINATE = "terminate called"


@dataclass(frozen=True)
class Kind:
    """One kind of job: its extra flags, torchrun's exit code and the ranks' exit code."""

    name: str
    flags: tuple[str, ...]
    torchrun_code: int
    rank_code: int
    # Runs in the output folder of the previous job of this kind (``resume`` of ``train``).
    reuses: str | None = None


KINDS: dict[str, Kind] = {
    "train": Kind("train", ("--steps", "2", "--checkpoint-every", "2"), 0, 0),
    "resume": Kind("resume", ("--steps", "3", "--resume"), 0, 0, reuses="train"),
    "config": Kind("config", ("--steps", "2", "--dp-shard", "3"), 1, 2),
    "nonfinite": Kind("nonfinite", ("--steps", "4", "--lr", "1e6", "--optimizer", "adamw"), 1, 3),
}


@dataclass(frozen=True)
class Outcome:
    """How one job ended."""

    number: int
    kind: str
    returncode: int
    rank_codes: tuple[int, ...]
    aborted: bool
    clean: bool
    seconds: float
    stderr: str


def run_job(number: int, kind: Kind, work: Path, env: dict[str, str], timeout_s: float) -> Outcome:
    """Run job ``number`` of ``kind`` under ``work`` and classify its exit."""
    out = work / f"{kind.reuses or kind.name}_out"
    if kind.reuses is None and out.exists():
        shutil.rmtree(out)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hp_train", *BASE, *kind.flags, "--out", str(out),
    ]  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, env=env, cwd=work, capture_output=True, text=True, timeout=timeout_s
        )
        returncode, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        returncode, stderr = -1, f"{tail}\n[exit_soak: the job ran past {timeout_s:g} s]"
    seconds = time.monotonic() - started
    codes = tuple(int(code) for code in _EXITCODE.findall(stderr))
    aborted = _TERMINATE in stderr or -signal.SIGABRT.value in codes
    allowed = {kind.rank_code, -signal.SIGTERM.value}
    clean = (
        returncode == kind.torchrun_code
        and not aborted
        and set(codes) <= allowed
        and (kind.rank_code == 0 or kind.rank_code in codes)
    )
    return Outcome(number, kind.name, returncode, codes, aborted, clean, seconds, stderr)


def _tail(text: str, lines: int) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    """Run the jobs; exit 0 when every one was clean, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=60, help="how many jobs (default 60)")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"the kinds to cycle through, comma-separated (default {','.join(KINDS)})",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/exit_soak"), help="scratch folder")
    p.add_argument("--pythonpath", default="", help="folders put before the installed packages")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--tail", type=int, default=15, help="stderr lines printed per failure")
    args = p.parse_args(argv)
    names = [name.strip() for name in args.kinds.split(",") if name.strip()]
    unknown = [name for name in names if name not in KINDS]
    if unknown or not names:
        p.error(f"--kinds: unknown {unknown or 'empty list'}; choose from {', '.join(KINDS)}")
    for name in names:
        needs = KINDS[name].reuses
        if needs is not None and (needs not in names or names.index(needs) > names.index(name)):
            p.error(f"--kinds: {name} resumes a {needs} job, so {needs} must come before it")
    work: Path = args.work
    failures = work / "failures"
    failures.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_SHOW_CPP_STACKTRACES", "1")
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (args.pythonpath, env.get("PYTHONPATH", "")) if part
        )
    counts: Counter[tuple[str, str]] = Counter()
    for number in range(args.jobs):
        kind = KINDS[names[number % len(names)]]
        got = run_job(number, kind, work, env, args.timeout)
        verdict = "clean" if got.clean else ("ABORT" if got.aborted else "FAILED")
        counts[(got.kind, verdict)] += 1
        print(
            f"job {number:4d} {got.kind:9s} rc {got.returncode:3d} ranks {list(got.rank_codes)} "
            f"{verdict} ({got.seconds:.1f} s)",
            flush=True,
        )
        if not got.clean:
            saved = failures / f"job_{number:04d}_{got.kind}.stderr"
            saved.write_text(got.stderr)
            end = _tail(got.stderr, args.tail)
            print(f"  stderr saved to {saved}; its end:\n{end}", flush=True)
    total = sum(counts.values())
    bad = sum(n for (_, verdict), n in counts.items() if verdict != "clean")
    print(f"\n{total} jobs, {total - bad} clean, {bad} not:")
    for (name, verdict), n in sorted(counts.items()):
        print(f"  {name:9s} {verdict:6s} {n}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
