"""Benchmark: fast recovery from a lost worker, disk checkpoints vs in-memory snapshots, side by
side in one run.

The job is the demo's (``noxfile.py``: ``DEMO_ARGS``, read from the noxfile so the two cannot
drift apart): the small Llama (dim 128, 4 layers) on CPython's documentation topics with a
2,048-token byte-level BPE (trained here into a temporary folder, a few seconds), FSDP 2 x TP 2
on 4 local CPU ranks (gloo, one thread each), Muon + AdamW, the held-out loss every 10 steps;
only ``--steps`` and the fault-tolerance flags differ. Every run is a real job:
``torchrun --standalone --nproc-per-node 4 --max-restarts 1 -m hp_train ... --resume-if-present``
in an output folder of its own. Three runs, one after the other, in this order (``memory``
between the two runs without snapshots, so that a drift of the machine's load weighs on both
references):

* ``baseline``: uninterrupted, no checkpoint, no snapshot: the reference step time and losses;
* ``memory``: an in-memory snapshot every step (``--snapshot-every 1``), no periodic checkpoint
  (snapshots in a temporary folder under ``/dev/shm``, removed afterwards);
* ``disk``: a disk checkpoint every ``CHECKPOINT_EVERY`` (50) steps.

In ``disk`` and ``memory`` the benchmark polls ``metrics.jsonl`` (every ``POLL_S``) and, as soon
as rank 0 has written the record of step index ``KILL_AT`` (75; the same for both), sends
SIGKILL to rank 1 (its pid from ``<out>/pids/rank_1.pid``); torchrun then stops the other
workers and restarts all four, which restore and carry on to ``STEPS`` (95). Reported per run:

* **work lost**: steps redone = steps completed when killed (the newest step written before the
  restart, plus one) minus the step recovered from (from the ``recovery: step N from ...`` line
  of rank 0's log). With snapshots this is 0 or 1: the copy is taken before the step's record
  is written, but its files are written in the background, so a kill just after a record can
  find the killed rank's newest snapshot incomplete and the recovery takes the one before;
* **recovery time**: wall time from the kill to the first record the restarted job writes (its
  arrival as the poller sees it: within ``POLL_S`` and the poller's own scheduling), with the
  moments in between: every old worker gone (torchrun's teardown), every new worker's pid file
  written (hp-train writes it once the process group is up and the data built, before the
  model), rank 0's recovery line (its timestamp in rank 0's log, millisecond resolution); and
  separately the restore time the recovery lines report (rank 0's and the slowest rank's). For
  scale, each run's launch to first step (a cold start) is reported too;
* **total wall time lost** = recovery time + work lost x the baseline's median step time, and
  the part of it after the relaunch (model build, restore, first step, redone steps: what the
  recovery mode changes). The relaunch before it (torchrun's teardown, four new interpreters
  importing torch and hp-train, the rendezvous) is the same mechanism for both and the noisiest
  part here: on 2 busy cores the new workers' store clients can time out (3 s a try) while the
  new rank 0 is still importing, which shows in torchrun's console output;
* **snapshot cost**: ``memory``'s median step before the kill against the mean of
  ``baseline``'s and ``disk``'s before its kill (two references without snapshots; how far apart
  they are is reported, as the noise), in two measures: ``step_time_s`` of ``metrics.jsonl``
  (which ends before the snapshot copy) and the interval between consecutive records' arrival
  (which includes the copy the step waits for and any slowdown from the background writer);
  plus the median ``snapshot_ms`` (that copy), as a fraction of the reference step. Steps with
  a held-out evaluation, a checkpoint or the first step are left out of the medians.

Correctness, checked bit for bit (``repr`` of the losses in ``metrics.jsonl``): every loss of
``memory`` and of ``disk`` -- before the kill and after the recovery -- equals ``baseline``'s loss
of the same step. A mismatch is reported (``bitwise_equal: false`` and the first step that
differs), not hidden.

This machine is shared and noisy: 4 ranks on 2 cores, so the restart (four new interpreters
importing torch and hp-train, the rendezvous, the model build) dominates the recovery time, and
the snapshot cost, a difference between runs made one after the other, is within the noise
unless it is large: compare the figures of one run, and the two references with each other.
Prints a table and one JSON line. About 2.5 minutes on 2 busy cores.

Run: ``nox -s bench -- recovery.py`` (or, in the dev venv, ``OMP_NUM_THREADS=1 python
benchmarks/recovery.py``). ``--steps``, ``--kill-at`` and ``--checkpoint-every`` change the
run (e.g. ``--steps 24 --kill-at 15 --checkpoint-every 10`` for a quick check); ``--keep DIR``
keeps every run's output folder, logs and torchrun's console output in a new folder ``DIR``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _machine import machine_info, machine_line

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
STEPS = 95
KILL_AT = 75  # step index (0-based, as metrics.jsonl records it) after which rank 1 is killed
KILLED_RANK = 1
CHECKPOINT_EVERY = 50
POLL_S = 0.02
RUN_TIMEOUT_S = 300.0  # a run that takes longer is a hang: stopped and reported
# "2026-12-05 18:06:22,123 rank 0 INFO hp_train...: recovery: step 76 from memory ... in 0.08 s"
RECOVERY_LINE = re.compile(
    r"^(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank (?P<rank>\d+) .*?"
    r"recovery: step (?P<step>\d+) from (?P<source>.+) in (?P<seconds>[0-9.]+) s$"
)


def demo_args() -> tuple[tuple[str, ...], str]:
    """``DEMO_ARGS`` and ``DEMO_VOCAB`` of the noxfile (read, not imported: nox need not be
    installed where the benchmark runs)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("DEMO_ARGS", "DEMO_VOCAB"):
                    assert node.value is not None
                    found[target.id] = ast.literal_eval(node.value)
    if set(found) != {"DEMO_ARGS", "DEMO_VOCAB"}:
        raise RuntimeError(f"noxfile.py: expected DEMO_ARGS and DEMO_VOCAB, found {sorted(found)}")
    return tuple(found["DEMO_ARGS"]), str(found["DEMO_VOCAB"])


def with_options(args: tuple[str, ...], **options: str) -> list[str]:
    """``args`` with each ``--name value`` of ``options`` (underscores for dashes) replaced or
    appended."""
    out = list(args)
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@dataclass
class Run:
    """What one job did, as the poller saw it."""

    name: str
    out: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() when read
    killed_at: float | None = None  # time.monotonic()
    killed_wall: float | None = None  # time.time(), for the log's timestamps
    killed_pid: int | None = None
    old_pids: dict[int, int] = field(default_factory=dict)  # rank -> pid before the kill
    stopped_at: float | None = None  # every old worker gone (time.monotonic())
    # Every rank's pid file names a new process: hp-train writes it once the process group is
    # up and the data built, before the model is.
    relaunched_at: float | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    began: float = 0.0  # time.monotonic() at the launch


def _read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines of ``path`` from byte ``offset`` on, and the offset after them."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    lines = [ln for ln in data[:end].decode("utf-8").split("\n") if ln.strip()]
    return lines, offset + end


def _pids(out: Path) -> dict[int, int]:
    """Rank -> worker pid, from ``<out>/pids/rank_<r>.pid`` (an empty or half-written file is
    left out)."""
    found = {}
    for path in (out / "pids").glob("rank_*.pid"):
        text = path.read_text().strip()
        if text.isdigit():
            found[int(path.stem.removeprefix("rank_"))] = int(text)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _watch_restart(run: Run, now: float) -> None:
    """After the kill: note when torchrun has stopped every old worker and when every rank's
    pid file names a new process."""
    if run.stopped_at is None and not any(_alive(p) for p in run.old_pids.values()):
        run.stopped_at = now
    if run.relaunched_at is None:
        pids = _pids(run.out)
        if len(pids) == WORLD and all(pids[r] != run.old_pids.get(r) for r in pids):
            run.relaunched_at = now


def run_job(name: str, args: list[str], out: Path, kill_at: int | None) -> Run:
    """One torchrun job in ``out``; with ``kill_at``, SIGKILL of rank ``KILLED_RANK`` once
    rank 0 has written the record of that step index."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "--max-restarts=1",
        "-m", "hp_train", *args, "--resume-if-present", "--quiet", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = Run(name, out)
    metrics = out / "metrics.jsonl"
    console = out.parent / f"{name}.console.txt"
    offset = 0
    began = run.began = time.monotonic()
    with console.open("wb") as sink:
        # A session of its own: a hung job is stopped as a whole (torchrun and its workers).
        proc = subprocess.Popen(
            cmd, cwd=out.parent, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            while True:
                done = proc.poll() is not None
                lines, offset = _read_new_lines(metrics, offset)
                now = time.monotonic()
                for line in lines:
                    record = json.loads(line)
                    record["step"] -= 1  # metrics.jsonl counts from 1; this benchmark from 0
                    run.records.append(record)
                    run.arrivals.append(now)
                    if kill_at is not None and run.killed_at is None and record["step"] >= kill_at:
                        run.old_pids = _pids(out)
                        pid = run.old_pids[KILLED_RANK]
                        run.killed_wall = time.time()
                        run.killed_at = time.monotonic()
                        os.kill(pid, signal.SIGKILL)
                        run.killed_pid = pid
                if run.killed_at is not None:
                    _watch_restart(run, now)
                if done:
                    break
                if now - began > RUN_TIMEOUT_S:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise RuntimeError(
                        f"{name}: no end after {RUN_TIMEOUT_S:.0f} s (a hang?); "
                        f"{len(run.records)} records, last {run.records[-1:]}; console "
                        f"tail:\n{_tail(console)}"
                    )
                time.sleep(POLL_S)
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    run.returncode = proc.returncode
    run.wall_s = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: torchrun exited {proc.returncode}; tail:\n{_tail(console)}")
    return run


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def recovery_lines(out: Path) -> list[dict[str, Any]]:
    """Every rank's ``recovery: step N from ... in S s`` lines (rank, step, source, seconds,
    wall time)."""
    found = []
    for log in sorted((out / "logs").glob("rank_*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = RECOVERY_LINE.match(line)
            if m:
                when = datetime.strptime(m["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append(
                    {
                        "rank": int(m["rank"]),
                        "step": int(m["step"]),
                        "source": m["source"],
                        "seconds": float(m["seconds"]),
                        "wall": when,
                    }
                )
    return found


def _plain(record: dict[str, Any]) -> bool:
    """A step with nothing but training in it (no eval, no checkpoint, not the first)."""
    return "eval_loss" not in record and "checkpoint" not in record and record["step"] != 0


def step_medians(run: Run, end: int | None = None) -> dict[str, float]:
    """Median ``step_time_s`` and median arrival interval (s) over the plain steps among the
    first ``end`` records, and the median ``snapshot_ms`` where recorded."""
    records, arrivals = run.records[:end], run.arrivals[:end]
    times = [r["step_time_s"] for r in records if _plain(r)]
    gaps = [
        arrivals[i] - arrivals[i - 1]
        for i in range(1, len(records))
        if _plain(records[i])
        and records[i]["step"] == records[i - 1]["step"] + 1
        and "eval_loss" not in records[i - 1]  # the previous gap's eval ends this one's start
    ]
    out = {"step_time_s": statistics.median(times), "interval_s": statistics.median(gaps)}
    snaps = [r["snapshot_ms"] for r in records if "snapshot_ms" in r]
    if snaps:
        out["snapshot_ms"] = statistics.median(snaps)
    return out


def compare_losses(run: Run, reference: dict[int, float]) -> dict[str, Any]:
    """Whether every loss of ``run`` equals the reference's of its step, bit for bit."""
    differ = [r["step"] for r in run.records if repr(r["loss"]) != repr(reference[r["step"]])]
    return {
        "bitwise_equal": not differ,
        "steps_compared": len(run.records),
        "first_differing_step": differ[0] if differ else None,
    }


def analyse(run: Run, baseline_step_s: float) -> dict[str, Any]:
    """The recovery figures of a killed run."""
    if run.killed_at is None or run.killed_wall is None:
        raise RuntimeError(f"{run.name}: the job ended before the kill's step")
    lines = recovery_lines(run.out)
    if not lines:
        raise RuntimeError(f"{run.name}: no 'recovery:' line in {run.out / 'logs'}")
    steps = {ln["step"] for ln in lines}
    if len(steps) != 1 or len(lines) != WORLD:
        raise RuntimeError(f"{run.name}: expected one recovery line per rank at one step: {lines}")
    recovered = steps.pop()
    # The restarted job's first record is of the recovered step; the same step index may also
    # appear once before the kill, so the last record of that step starts the restarted part.
    first_after = max(i for i, r in enumerate(run.records) if r["step"] == recovered)
    if run.arrivals[first_after] < run.killed_at:
        raise RuntimeError(f"{run.name}: no record of step {recovered} after the kill")
    before = run.records[:first_after]
    completed = max(r["step"] for r in before) + 1
    lost_steps = completed - recovered
    recovery_s = run.arrivals[first_after] - run.killed_at
    rank0 = next(ln for ln in lines if ln["rank"] == 0)
    restored_s = rank0["wall"] - run.killed_wall
    if run.stopped_at is None or run.relaunched_at is None:
        raise RuntimeError(f"{run.name}: the workers' restart was not seen in {run.out / 'pids'}")
    return {
        "killed_pid": run.killed_pid,
        "completed_when_killed": completed,
        "recovered_from": recovered,
        "source": rank0["source"],
        "work_lost_steps": lost_steps,
        "recovery_s": round(recovery_s, 3),
        "kill_to_stopped_s": round(run.stopped_at - run.killed_at, 3),
        "kill_to_relaunched_s": round(run.relaunched_at - run.killed_at, 3),
        "kill_to_restored_s": round(restored_s, 3),
        "restored_to_first_step_s": round(recovery_s - restored_s, 3),
        "restore_s_rank0": rank0["seconds"],
        "restore_s_max": max(ln["seconds"] for ln in lines),
        "total_lost_s": round(recovery_s + lost_steps * baseline_step_s, 3),
        "lost_after_relaunch_s": round(
            recovery_s - (run.relaunched_at - run.killed_at) + lost_steps * baseline_step_s, 3
        ),
        "steps_before_kill": len(before),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line: the run's length, the kill's step and the checkpoint interval."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of every run")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="a new folder to keep the runs' outputs, logs and console output in (default: "
        "a temporary folder, removed)",
    )
    parser.add_argument(
        "--kill-at", type=int, default=KILL_AT, help="step index after which rank 1 is killed"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=CHECKPOINT_EVERY, help="disk run's interval"
    )
    opts = parser.parse_args(argv)
    if not opts.checkpoint_every <= opts.kill_at < opts.steps - 1:
        parser.error(
            f"need --checkpoint-every <= --kill-at < --steps - 1, got {opts.checkpoint_every}, "
            f"{opts.kill_at}, {opts.steps}"
        )
    return opts


def snapshot_cost(
    base: dict[str, float], disk: dict[str, float], mem: dict[str, float]
) -> dict[str, float]:
    """What snapshotting every step costs: ``mem`` (the memory run before its kill) against
    the mean of the two references without snapshots, ``base`` (the baseline run) and ``disk``
    (the disk run before its kill); their spread is the machine's noise."""
    ref_step = (base["step_time_s"] + disk["step_time_s"]) / 2
    ref_interval = (base["interval_s"] + disk["interval_s"]) / 2
    return {
        "baseline_step_ms": round(base["step_time_s"] * 1e3, 1),
        "baseline_interval_ms": round(base["interval_s"] * 1e3, 1),
        "disk_step_ms": round(disk["step_time_s"] * 1e3, 1),
        "disk_interval_ms": round(disk["interval_s"] * 1e3, 1),
        "memory_step_ms": round(mem["step_time_s"] * 1e3, 1),
        "memory_interval_ms": round(mem["interval_s"] * 1e3, 1),
        "snapshot_ms": round(mem["snapshot_ms"], 2),
        "snapshot_fraction": round(mem["snapshot_ms"] / 1e3 / ref_step, 4),
        "step_fraction": round(mem["step_time_s"] / ref_step - 1, 4),
        "interval_fraction": round(mem["interval_s"] / ref_interval - 1, 4),
        "reference_spread": round(abs(base["interval_s"] - disk["interval_s"]) / ref_interval, 4),
    }


def print_table(rows: dict[str, dict[str, Any]], cost: dict[str, float]) -> None:
    """The recovery table and the snapshot cost, for people (the JSON line follows)."""
    print(
        f"\n{'run':<7} {'killed':>6} {'from':>5} {'redone':>6} {'stopped':>8} {'relaunch':>8} "
        f"{'restored':>8} {'1st step':>8} {'restore':>7} {'lost s':>7} {'hp part':>7}  "
        "losses vs baseline"
    )
    for name, row in rows.items():
        same = (
            "bitwise equal"
            if row["losses"]["bitwise_equal"]
            else (f"DIFFER from step {row['losses']['first_differing_step']}")
        )
        print(
            f"{name:<7} {row['completed_when_killed']:>6} {row['recovered_from']:>5} "
            f"{row['work_lost_steps']:>6} {row['kill_to_stopped_s']:>8.2f} "
            f"{row['kill_to_relaunched_s']:>8.2f} {row['kill_to_restored_s']:>8.2f} "
            f"{row['recovery_s']:>8.2f} {row['restore_s_max']:>7.2f} "
            f"{row['total_lost_s']:>7.2f} {row['lost_after_relaunch_s']:>7.2f}  {same}"
        )
    print(
        "killed = steps completed at the kill; redone = killed - from; seconds from the kill "
        "until: the old workers are all gone (stopped), every new rank has joined the process "
        "group and built its data (relaunch: its pid file), rank 0 logs its recovery "
        "(restored), the restarted job's first step is written (1st step = the recovery "
        "time); restore = the slowest rank's restore as its log reports it; lost = recovery "
        "time + redone x the baseline's median step "
        f"({cost['baseline_step_ms']:.0f} ms); hp part = lost - relaunch (model build, "
        "restore, first step, redone steps: what the recovery mode changes; the relaunch is "
        "torchrun and new interpreters, the same for both)"
    )
    print(
        f"snapshot every step: copy {cost['snapshot_ms']:.2f} ms median = "
        f"{100 * cost['snapshot_fraction']:.2f}% of a step; median record interval "
        f"{cost['memory_interval_ms']:.0f} ms vs {cost['baseline_interval_ms']:.0f} (baseline) "
        f"and {cost['disk_interval_ms']:.0f} (disk before its kill) without snapshots: "
        f"{100 * cost['interval_fraction']:+.1f}% (references {100 * cost['reference_spread']:.1f}"
        f"% apart); step_time_s {cost['memory_step_ms']:.0f} vs {cost['baseline_step_ms']:.0f} "
        f"and {cost['disk_step_ms']:.0f} ms ({100 * cost['step_fraction']:+.1f}%)"
    )


def main() -> None:
    opts = parse(sys.argv[1:])
    print(f"{machine_line()}; {WORLD} gloo ranks with 1 thread each (torchrun)", flush=True)
    args, vocab = demo_args()
    common = with_options(args, steps=str(opts.steps))
    kill_at = opts.kill_at
    print(
        f"job: the demo's ({' '.join(common)}); disk: checkpoint every "
        f"{opts.checkpoint_every}; memory: --snapshot-every 1; rank {KILLED_RANK} SIGKILLed "
        f"after step index {kill_at}",
        flush=True,
    )
    started = time.monotonic()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with (
        tempfile.TemporaryDirectory(prefix="bench_recovery_") as scratch,
        tempfile.TemporaryDirectory(prefix="bench_recovery_snap_", dir=shm) as snapshots,
    ):
        root = scratch
        if opts.keep is not None:
            opts.keep.mkdir(parents=True)  # a new folder: never mixes with an earlier run's
            root = str(opts.keep)
        tokenizer = Path(root) / "tokenizer"
        subprocess.run(
            [
                sys.executable, "-m", "hp_train.data.tokenizer", "train", "--data", "pydoc",
                "--vocab-size", vocab, "--eval-fraction", "0.1", "--out", str(tokenizer),
            ],
            check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        # memory between the two runs without snapshots: a drift of the machine's load over
        # the benchmark weighs on the two references alike.
        variants: dict[str, tuple[list[str], int | None]] = {
            "baseline": (with_options(tuple(common), checkpoint_every="0"), None),
            "memory": (
                with_options(
                    tuple(common), checkpoint_every="0", snapshot_every="1", snapshot_dir=snapshots
                ),
                kill_at,
            ),
            "disk": (
                with_options(tuple(common), checkpoint_every=str(opts.checkpoint_every)),
                kill_at,
            ),
        }
        runs: dict[str, Run] = {}
        for name, (job_args, kill) in variants.items():
            out = Path(root) / name
            out.mkdir()
            job = [*job_args, "--tokenizer", str(tokenizer)]
            runs[name] = run_job(name, job, out, kill)
            done = runs[name]
            print(
                f"  {name}: {len(done.records)} records in {done.wall_s:.0f} s (launch to first "
                f"step {done.arrivals[0] - done.began:.1f} s)",
                flush=True,
            )
        base = runs["baseline"]
        reference = {r["step"]: r["loss"] for r in base.records}
        base_step = step_medians(base)
        rows: dict[str, dict[str, Any]] = {}
        for name in ("disk", "memory"):
            row = analyse(runs[name], base_step["step_time_s"])
            row["before_kill"] = step_medians(runs[name], row["steps_before_kill"])
            row["losses"] = compare_losses(runs[name], reference)
            rows[name] = row
    cost = snapshot_cost(base_step, rows["disk"]["before_kill"], rows["memory"]["before_kill"])
    print_table(rows, cost)
    print(f"wall {time.monotonic() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "machine": machine_info(),
                "config": {
                    "args": common,
                    "world": WORLD,
                    "steps": opts.steps,
                    "kill_after_step_index": kill_at,
                    "killed_rank": KILLED_RANK,
                    "checkpoint_every": opts.checkpoint_every,
                    "snapshot_every": 1,
                    "poll_s": POLL_S,
                },
                "runs": rows,
                "snapshot_cost": cost,
                "wall_s": {name: round(r.wall_s, 1) for name, r in runs.items()},
                "launch_to_first_step_s": {
                    name: round(r.arrivals[0] - r.began, 2) for name, r in runs.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
