"""A run resumed from in-memory snapshots continues bit for bit, from whichever source is left:
its own snapshot, the buddy's replica fetched over the process group, an older step, the disk
checkpoint (each rank of the rank pool given a snapshot folder of its own, so that the two
ranks are two "hosts" whose snapshots replicate to each other).

The runs are those of the command line (``hp_train.config.cli.parse``, then the trainer) with
dropout on, so that a restore that missed the random generators' states would change the
losses. The interrupted run fails in step 6 (an exception raised on every rank, standing in
for a crash), so its snapshots stay; a run that ends deletes its own."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from hp_testing import run_on_ranks
from hp_testing.checkpoints import assert_identical, checkpoint_state
from hp_train.config.cli import parse
from hp_train.runtime import init_runtime
from hp_train.trainer import Trainer


class _CrashError(Exception):
    """What the interrupted run fails with."""


STEPS, FIRST = 10, 6
ARGS = [
    "--data", "synthetic", "--global-batch", "4", "--seq-len", "16", "--quiet", "--threads",
    "1", "--dropout", "0.1", "--snapshot-every", "1",
    "--checkpoint-every", "5",
]  # fmt: skip


def _train_on_pool_rank(
    argv: list[str], snapshots: str, crash_at: int | None = None
) -> dict[str, object]:
    """One rank of ``hp_train *argv`` with this rank's own snapshot folder
    (``snapshots/rank_<r>``), failing when step ``crash_at`` starts if given (after the last
    snapshot's background write finished); returns the step it started at (None: crashed)."""
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    options = replace(options, snapshot_dir=Path(snapshots) / f"rank_{runtime.rank}")
    trainer = Trainer(model, parallel, config, options, runtime)
    if crash_at is not None:
        step_of = trainer.train_step

        def crashing(step: int, monitored: bool) -> dict[str, object]:
            if step == crash_at:
                raise _CrashError(step)
            return step_of(step, monitored)

        trainer.train_step = crashing  # type: ignore[method-assign]
    try:
        return {"first_step": trainer.run().first_step}
    except _CrashError:
        assert trainer.keeper is not None
        trainer.keeper.wait()
        return {"first_step": None}


def _run(out: Path, snapshots: Path, steps: int, *extra: str, crash_at: int | None = None) -> int:
    argv = [*ARGS, "--steps", str(steps), "--out", str(out), *extra]
    results = run_on_ranks(2, _train_on_pool_rank, argv, str(snapshots), crash_at, timeout=300)
    if crash_at is not None:
        assert [r["first_step"] for r in results] == [None, None]
        return 0
    starts = {int(str(r["first_step"])) for r in results}
    assert len(starts) == 1, results
    return starts.pop()


def _losses(out: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[int(record["step"])] = float(record["loss"])  # a resumed step overwrites
    return losses


def _recovery_line(out: Path) -> str:
    lines = [
        line
        for line in (out / "logs" / "rank_0.log").read_text().splitlines()
        if "recovery: " in line and "no snapshot" not in line
    ]
    assert lines, "no recovery line in rank 0's log"
    return lines[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The uninterrupted run of ``STEPS`` and a run stopped after ``FIRST`` (its output and
    snapshot folders, copied by each test before it damages them)."""
    base = tmp_path_factory.mktemp("snapshot_runs")
    reference = base / "reference"
    assert _run(reference, base / "reference_snapshots", STEPS) == 0
    # A run that ended freed its snapshots' memory.
    assert not list((base / "reference_snapshots").rglob("step_*"))
    first = base / "first"
    _run(first, base / "first_snapshots", STEPS, crash_at=FIRST)
    assert len(list((base / "first_snapshots").rglob("step_*.snap"))) == 8  # 2 steps x 4
    return reference, first


def _copy(runs: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    first = runs[1]
    out, snapshots = tmp_path / "out", tmp_path / "snapshots"
    shutil.copytree(first, out)
    shutil.copytree(first.parent / "first_snapshots", snapshots)
    return out, snapshots


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _snap(snapshots: Path, folder_of: int, kind: str, owner: int, step: int) -> Path:
    return snapshots / f"rank_{folder_of}" / kind / f"rank_{owner}" / f"step_{step:08d}.snap"


def _final_state(out: Path, scratch: Path) -> dict[str, object]:
    """The last checkpoint's whole state (model, optimizer, random generators)."""
    return checkpoint_state(out / "checkpoints" / f"step_{STEPS:06d}", scratch)


CASES = {
    # Every rank reads its own snapshot of step 6 from its own folder.
    "own": ([], FIRST, "step 6 from memory snapshots (own: 0, 1)"),
    # Rank 1's own copy is damaged: rank 0 sends the replica it keeps.
    "replica": (
        [(1, "own", 1, FIRST)],
        FIRST,
        "step 6 from memory snapshots (own: 0; buddy replicas: 1 from rank 0)",
    ),
    # Both copies of rank 1's step 6 are damaged: every rank goes back to step 5.
    "older step": (
        [(1, "own", 1, FIRST), (0, "replica", 1, FIRST)],
        FIRST - 1,
        "step 5 from memory snapshots (own: 0, 1)",
    ),
    # Nothing of rank 1 is left: the disk checkpoint of step 5.
    "disk": (
        [(1, "own", 1, FIRST), (0, "replica", 1, FIRST), (1, "own", 1, 5), (0, "replica", 1, 5)],
        5,
        "step 5 from disk",
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_from_the_next_good_source(
    runs: tuple[Path, Path], tmp_path: Path, case: str
) -> None:
    """The run of 6 steps, its snapshots damaged as ``case`` says, resumed to 10: it starts
    from the source the case leaves (its start-up line names it) and its losses from there
    equal the uninterrupted run's bit for bit, as does its last checkpoint (model, optimizer
    state, random generators); every damaged file it tried is named in its log."""
    damage, start, said = CASES[case]
    out, snapshots = _copy(runs, tmp_path)
    for folder_of, kind, owner, step in damage:
        _flip_byte(_snap(snapshots, folder_of, kind, owner, step))
    assert _run(out, snapshots, STEPS, "--resume") == start
    assert said in _recovery_line(out)
    want, got = _losses(runs[0]), _losses(out)
    for step in range(start + 1, STEPS + 1):  # metrics.jsonl counts steps from 1
        assert got[step] == want[step], (case, step, got[step], want[step])
    logged = (out / "logs" / "rank_0.log").read_text()
    for folder_of, kind, owner, step in damage:
        name = f"rank_{folder_of}/{kind}/rank_{owner}/step_{step:08d}.snap"
        assert f"{name}: SHA-256 differs from its header's" in logged, (case, name)
    assert_identical(
        _final_state(out, tmp_path / "got.pt"), _final_state(runs[0], tmp_path / "want.pt"), case
    )


@pytest.mark.multiprocess
def test_another_world_size_takes_the_disk_checkpoint(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Snapshots of 2 ranks do not fit a job of 1 (its state is laid out otherwise): the
    restart takes the newest disk checkpoint, resharded, and says so."""
    out, snapshots = _copy(runs, tmp_path)
    argv = [*ARGS, "--steps", str(STEPS), "--out", str(out), "--resume"]
    (result,) = run_on_ranks(1, _train_on_pool_rank, argv, str(snapshots), timeout=300)
    assert result["first_step"] == 5
    logged = (out / "logs" / "rank_0.log").read_text()
    assert "recovery: no snapshot to take (step 5 from the newest disk checkpoint)" in logged
    assert "recovery: step 5 from disk" in logged


def _logged_steps_at_each_snapshot(argv: list[str], snapshots: str) -> list[tuple[int, int]]:
    """One rank of a run with a snapshot every step; on rank 0, at each snapshot: the steps
    done and the last step ``metrics.jsonl`` holds by then."""
    from hp_train.recovery.keeper import SnapshotKeeper

    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    options = replace(options, snapshot_dir=Path(snapshots) / f"rank_{runtime.rank}")
    seen: list[tuple[int, int]] = []
    after_step = SnapshotKeeper.after_step

    def spying(keeper: SnapshotKeeper, steps_done: int) -> bool:
        if runtime.rank == 0:
            lines = (Path(options.out_dir) / "metrics.jsonl").read_text().splitlines()
            seen.append((steps_done, int(json.loads(lines[-1])["step"])))
        return after_step(keeper, steps_done)

    SnapshotKeeper.after_step = spying  # type: ignore[method-assign,assignment]
    try:
        Trainer(model, parallel, config, options, runtime).run()
    finally:
        SnapshotKeeper.after_step = after_step  # type: ignore[method-assign]
    return seen


@pytest.mark.multiprocess
def test_a_snapshot_is_taken_after_its_steps_are_logged(tmp_path: Path) -> None:
    """A job killed between a snapshot and the record of its last step would, recovered from
    that snapshot, never log the step (a gap in metrics.jsonl). Every snapshot of ``n`` steps
    is taken once the record of step ``n - 1`` is written."""
    argv = [*ARGS, "--steps", "4", "--out", str(tmp_path / "out")]
    seen = run_on_ranks(
        2, _logged_steps_at_each_snapshot, argv, str(tmp_path / "snapshots"), timeout=300
    )[0]
    assert seen == [(n, n) for n in range(1, 5)]  # metrics.jsonl counts steps from 1
