"""Faults: what a user sees when training or its checkpoints go wrong.

Every case is one entry of :data:`FAULTS` (the fault, what the job does, the message the user
reads, ``<...>`` standing for what varies); the tests run the main job with the fault and find
that message in what it said (:func:`_expect`), and the README's "Faults" table is made from
the entries (:func:`fault_table`, checked by :func:`test_readme_fault_table_is_the_cases`).

The runs go through the command line's code (``hp_train.config.cli.parse``, then the ``Trainer``) in
the shared rank pool, as in ``test_resume.py``, at world 2 (world 4 for two cases); two jobs
are launched with torchrun and one as a plain process to see the exit codes. Faults are
injected from here: NaN into one rank's gradient, loss or weights (wrapping the trainer's
methods in the worker), ``ENOSPC`` from the checkpoint writer of one rank, a rank killing
itself mid-save, a load failing on one rank, files of a checkpoint truncated, deleted,
overwritten, emptied or bit-flipped, its manifest deleted, its ``.metadata`` rewritten as an
hp-train before manifests wrote it. A SIGKILL of a rank at a step is
``test_resume.py::test_resume_after_sigkill_of_one_rank``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hp_dtensor import DTensor
from hp_testing import RankFailure, run_on_ranks
from hp_testing.checkpoints import checkpoint_state
from hp_train.checkpoint.__main__ import main as checkpoint_command
from hp_train.checkpoint.dcp import FORMAT_KEY, LEGACY_MARK, MANIFEST_FILE, CheckpointError
from hp_train.config.cli import EXIT_CHECKPOINT, EXIT_NONFINITE, parse
from hp_train.config.schema import ConfigError, TrainConfig
from hp_train.observe.metrics import read_metrics
from hp_train.observe.nonfinite import NonFiniteError
from hp_train.runtime import init_runtime
from hp_train.trainer import Trainer
from test_resume import ARGS, _command, _env


# ------------------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Fault:
    """One row of the README's table.

    Attributes:
        fault: what went wrong.
        outcome: what the job does (exit code, what it keeps).
        message: what it says (``<...>``: a part that varies), on rank 0's stderr and in
            every rank's log file.
        tested_in: the test file that checks it, when not this one.
    """

    fault: str
    outcome: str
    message: str
    tested_in: str = ""


FAULTS: dict[str, Fault] = {
    "nan-lr": Fault(
        "`--lr 1e6` (AdamW): the loss or gradients become NaN/inf",
        "stops before the optimizer step applies them; exit code 3 on every rank; the "
        "checkpoints written before stay the latest (all finite)",
        "step <n>: <k> gradient piece(s) over the ranks are non-finite; first non-finite "
        "gradient of <name> (rank <r>); stopped before the optimizer step applied it. No "
        "checkpoint holds non-finite state (the latest is <checkpoint>). Lower the learning "
        "rate, clip with --clip-grad-norm, or skip such steps with --skip-nonfinite N",
    ),
    "nan-grad": Fault(
        "NaN in one rank's gradient (FSDP, FSDP x TP at world 4, a pipeline stage without the "
        "loss)",
        "the same stop (exit code 3), naming the parameter and the rank",
        "step <n>: <k> gradient piece(s) over the ranks are non-finite; first non-finite "
        "gradient of <name> (rank <r>); stopped before the optimizer step applied it",
    ),
    "nan-loss-accum": Fault(
        "NaN loss in one micro-step of `--grad-accum 2`",
        "the same stop (exit code 3)",
        "step <n>: the global loss is nan and <k> gradient piece(s) over the ranks are "
        "non-finite; first non-finite gradient of <name> (rank <r>)",
    ),
    "skip": Fault(
        "`--skip-nonfinite N` and at most N non-finite steps",
        "each is skipped: gradients dropped, no optimizer step (the LR schedule and the data "
        'move on); `"skipped": true` in its metrics record, listed in the summary; exit 0',
        "step <n>: <what>; first non-finite gradient of <name> (rank <r>): skipped the step, no "
        "optimizer step (<i> of at most <limit>, --skip-nonfinite)",
    ),
    "skip-exceeded": Fault(
        "`--skip-nonfinite N` and a non-finite step more",
        "stops (exit code 3)",
        "step <n>: <what>; more than --skip-nonfinite <limit> steps were non-finite (<steps>)",
    ),
    "nan-weights": Fault(
        "an optimizer step of finite gradients leaves a weight non-finite",
        "no checkpoint is written from it; exit code 3",
        "after step <n>: first non-finite parameter of <name> (rank <r>); not writing "
        "checkpoint step_<step> from non-finite state",
    ),
    "resume-after-nan": Fault(
        "`--resume` after a non-finite stop",
        "resumes from the latest checkpoint, which is finite",
        "resumed from <checkpoint> (step <n>)",
    ),
    "kill-step": Fault(
        "SIGKILL of one rank mid-run",
        "torchrun ends the job (non-zero); `--resume` continues from the latest complete "
        "checkpoint, bit for bit",
        "resumed from <checkpoint> (step <n>)",
        tested_in="test_resume.py",
    ),
    "kill-save": Fault(
        "a rank killed while a checkpoint is written",
        "the half-written `step_<n>.partial` is never taken; `--resume` continues from the "
        "one before (and the next save of that step replaces the partial one)",
        "resumed from <checkpoint> (step <n>)",
    ),
    "disk-full": Fault(
        "disk full while saving (a rank's tensor file, or rank 0's text files)",
        "exit code 4 on every rank (none left waiting); the partial checkpoint stays "
        "`.partial`; `--resume` continues from the latest complete one",
        "could not write checkpoint <dir> (rank <r>: <error>No space left on device<more>); it "
        "stays incomplete (.partial, never taken by --resume) and the earlier checkpoints "
        "are untouched",
    ),
    "truncated": Fault(
        "the latest checkpoint's `.distcp` file truncated",
        "`--resume` skips it with a warning and loads the newest one that verifies",
        "--resume: skipping checkpoint <checkpoint>: <file>.distcp: <n> bytes, the manifest "
        "says <m>; trying the next older one",
    ),
    "deleted": Fault(
        "a `.distcp` file deleted",
        "skipped likewise",
        "--resume: skipping checkpoint <checkpoint>: <file>.distcp: missing",
    ),
    "overwritten": Fault(
        "bytes of a `.distcp` file overwritten (same size)",
        "skipped likewise",
        "--resume: skipping checkpoint <checkpoint>: <file>.distcp: SHA-256 differs from the "
        "manifest's (same size)",
    ),
    "empty-metadata": Fault(
        "an empty `.metadata`",
        "skipped likewise",
        "--resume: skipping checkpoint <checkpoint>: empty .metadata (0 bytes)",
    ),
    "data-state": Fault(
        "`data_state.json` corrupted",
        "skipped likewise",
        "--resume: skipping checkpoint <checkpoint>: data_state.json: <n> bytes, the manifest "
        "says <m>",
    ),
    "manifest": Fault(
        "`manifest.json` corrupted",
        "skipped likewise",
        "--resume: skipping checkpoint <checkpoint>: manifest.json: unreadable (<error>)",
    ),
    "none-verifies": Fault(
        "no checkpoint verifies",
        "exit code 4 on every rank, before any step",
        "--resume: no checkpoint in <dir> verifies (<checkpoint>: <problem>; <checkpoint>: "
        "<problem>). Put a good copy back and pass it with --resume-from, or start over "
        "without --resume",
    ),
    "resume-from-corrupt": Fault(
        "`--resume-from DIR` of a checkpoint that does not verify",
        "exit code 4",
        "--resume-from <checkpoint> does not verify: <problem>. Pick another checkpoint "
        "(--resume takes the newest that verifies)",
    ),
    "resume-from-missing": Fault(
        "`--resume-from DIR` that does not exist",
        "exit code 2 (configuration error)",
        "--resume-from <dir>: no such checkpoint directory",
    ),
    "resume-from-folder": Fault(
        "`--resume-from` the checkpoints folder instead of one checkpoint",
        "exit code 2",
        "--resume-from <dir> is a folder of checkpoints, not one: pass one of them (the newest "
        "is <checkpoint>), or --resume to take the newest that verifies",
    ),
    "manifest-deleted": Fault(
        "`manifest.json` deleted from a checkpoint this version wrote, and one bit of a "
        "`.distcp` file flipped (or 4 KiB overwritten)",
        "skipped likewise, the newest one that verifies loaded (bit for bit): its `.metadata` "
        "holds the format marker `hp_train_format`, so it is not taken for an old checkpoint; "
        "`--resume-from` it: exit code 4",
        "--resume: skipping checkpoint <checkpoint>: manifest.json: missing, though hp-train "
        "wrote this checkpoint with one (its .metadata holds the format marker "
        "hp_train_format): its files cannot be verified",
    ),
    "legacy-unmarked": Fault(
        "a checkpoint without `manifest.json` nor format marker (written before manifests), "
        "not marked as old",
        "skipped likewise (`--resume-from` it: exit code 4), saying how to mark it",
        "--resume: skipping checkpoint <checkpoint>: manifest.json: missing, and the "
        "checkpoint is not marked as written before hp-train checksummed its checkpoints; if "
        "it is that old, mark it with: python -m hp_train.checkpoint mark-legacy <checkpoint>",
    ),
    "legacy": Fault(
        "that checkpoint marked with `python -m hp_train.checkpoint mark-legacy DIR` (which "
        "refuses a checkpoint with the format marker or a manifest)",
        "loaded unverified, with a warning (its `.metadata` must read and its files be long "
        "enough)",
        "checkpoint <checkpoint> has no manifest.json and is marked as written before hp-train "
        "checksummed its checkpoints (legacy_format): loading it unverified",
    ),
    "load-fails": Fault(
        "a checkpoint that passes its check but whose data torch cannot read (a marked old "
        "one with 4 KiB of a `.distcp` file overwritten; a read failing on one rank)",
        "`--resume` skips it on every rank alike (one gather agrees, whichever rank failed) "
        "and loads the next older one whole, bit for bit; `--resume-from` it: exit code 4",
        "--resume: skipping checkpoint <checkpoint>: it verified but did not load (rank <r>: "
        "<error>); trying the next older one",
    ),
    "resume-nothing": Fault(
        "`--resume` with no checkpoint in `<out>/checkpoints`",
        "exit code 2 on every rank, one line, before any step (it used to start a new run)",
        "--resume: no checkpoint to resume from in <dir>; leave --resume out to start a new "
        "run, or pass --resume-if-present to start one when there is nothing to resume",
    ),
    "resume-partial": Fault(
        "`--resume` with only an unfinished `step_<n>.partial` there",
        "exit code 2 on every rank, one line naming it",
        "--resume: no checkpoint to resume from in <dir> (only <partial>: a save that never "
        "finished, since a job stopped while writing it; never resumed from); leave --resume "
        "out to start a new run, or pass --resume-if-present to start one when there is "
        "nothing to resume",
    ),
    "resume-if-present": Fault(
        "`--resume-if-present` (`[run] resume_if_present`) with no checkpoint",
        "starts a new run at step 0 (exit 0); with a checkpoint, as `--resume`",
        "--resume-if-present: no checkpoint in <dir>; starting at step 0",
    ),
    "stall": Fault(
        "one rank never joins a collective (collective timeout `HP_TRAIN_COLLECTIVE_TIMEOUT`, "
        "the rank stalled by `HP_TRAIN_INJECT_STALL`)",
        "every rank waiting for it raises `hp_dtensor.watchdog.CollectiveTimeoutError` at the "
        "timeout; torchrun stops the stalled rank and exits non-zero",
        "<collective> over group <group> did not complete within the <timeout> s timeout "
        "(rank <rank>, its collective #<n> over this group, failed after <elapsed> s): rank "
        "<missing> of the group did not arrive",
        tested_in="test_fault_timeout.py",
    ),
    "skip-negative": Fault(
        "`--skip-nonfinite -1`",
        "exit code 2, before any process group",
        "skip_nonfinite must be an integer >= 0 (0: stop at the first non-finite step), got -1",
    ),
}


def fault_table() -> str:
    """The cases as the README's Markdown table."""
    rows = ["| fault | what the job does | message |", "| --- | --- | --- |"]
    rows += [f"| {f.fault} | {f.outcome} | `{f.message}` |" for f in FAULTS.values()]
    return "\n".join(rows)


def _pattern(template: str, values: dict[str, object]) -> str:
    """A regex of a message template: ``<name>`` is ``values[name]`` where given, else any
    text."""
    parts = re.split(r"<(\w+)>", template)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        else:
            out.append(re.escape(str(values[part])) if part in values else ".*?")
    return "".join(out)


def _expect(key: str, text: str, **values: object) -> None:
    """``FAULTS[key].message`` (with ``values`` for its placeholders) is in ``text``."""
    pattern = _pattern(FAULTS[key].message, values)
    assert re.search(pattern, text, flags=re.DOTALL), (
        f"{key}: {FAULTS[key].message!r} with {values} not in:\n{text[-3000:]}"
    )


def test_readme_fault_table_is_the_cases() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert fault_table() in readme


def test_every_case_is_checked() -> None:
    """Each case's key is passed to :func:`_expect` in this file (directly or through
    :data:`CORRUPTIONS`), or it names its test file."""
    source = Path(__file__).read_text()
    checked = {key for key, _ in CORRUPTIONS.values()}
    checked |= set(re.findall(r'_expect\(\s*"([\w-]+)"', source))
    for key, fault in FAULTS.items():
        if fault.tested_in:
            assert (Path(__file__).parent / fault.tested_in).is_file()
        else:
            assert key in checked, key


# ------------------------------------------------------------------------- in the pool
#: A short run: 2 checkpoints (after steps 2 and 4); tp 2 at world 2 (ARGS), FSDP with --tp 1.
SHORT = [*ARGS, "--steps", "4", "--checkpoint-every", "2"]


@dataclass(frozen=True)
class Poison:
    """NaN put into ``what`` (``gradient``: after backward; ``parameter``: after the optimizer
    step; ``loss``: of the first micro-step) of parameter ``name`` on ``rank`` at ``steps``."""

    rank: int
    steps: tuple[int, ...]
    name: str = "layers.0.ffn.w1.weight"
    what: str = "gradient"


@dataclass(frozen=True)
class Disk:
    """The save of ``step``'s checkpoint fails on ``rank``: ``full`` (ENOSPC from its tensor
    file; from ``data_state.json`` with ``text``) or ``kill`` (the rank SIGKILLs itself)."""

    rank: int
    step: int
    kind: str = "full"


@dataclass(frozen=True)
class Outcome:
    """What a run on one rank gave."""

    first_step: int | None = None
    error: str | None = None
    message: str = ""
    skipped: list[int] = field(default_factory=list)
    adam_steps: int | None = None
    losses: dict[int, float] = field(default_factory=dict)


def _nan_into(trainer: Trainer, poison: Poison, grad: bool) -> None:
    if dist.get_rank() != poison.rank:
        return
    for name, p in trainer.model.named_parameters():
        if name == poison.name:
            target = p.grad if grad else p
            assert target is not None
            local = target.to_local() if isinstance(target, DTensor) else target
            assert local.numel() > 0, f"rank {poison.rank} holds no piece of {name}"
            with torch.no_grad():
                local.view(-1)[0] = math.nan
            return
    raise AssertionError(f"no parameter {poison.name}")


def _poison(trainer: Trainer, poison: Poison) -> None:
    """Wrap the trainer's methods (in this worker) to put NaN where ``poison`` says."""
    current = {"step": -1, "micro": 0}
    train_step, global_loss, loss = trainer.train_step, trainer._global_loss, trainer._loss

    def step(step: int, monitored: bool) -> dict[str, Any]:
        current.update(step=step, micro=0)
        record = train_step(step, monitored)
        if poison.what == "parameter" and step in poison.steps:
            _nan_into(trainer, poison, grad=False)
        return record

    def checked(local: float) -> tuple[float, int]:
        if poison.what == "gradient" and current["step"] in poison.steps:
            _nan_into(trainer, poison, grad=True)
        return global_loss(local)

    def micro_loss(batch: Any) -> torch.Tensor:
        value = loss(batch)
        first = current["micro"] == 0
        current["micro"] += 1
        at = poison.what == "loss" and current["step"] in poison.steps and first
        if at and dist.get_rank() == poison.rank:
            value = value * math.nan
        return value

    setattr(trainer, "train_step", step)  # noqa: B010 - instance attributes over methods
    setattr(trainer, "_global_loss", checked)  # noqa: B010
    setattr(trainer, "_loss", micro_loss)  # noqa: B010


@contextlib.contextmanager
def _failing_disk(disk: Disk | None) -> Iterator[None]:
    """The checkpoint writer of ``disk.rank`` fails at ``disk.step``'s save (restored after)."""
    if disk is None or dist.get_rank() != disk.rank:
        yield
        return
    from torch.distributed.checkpoint import filesystem

    target = f"step_{disk.step:06d}.partial"
    create_stream = filesystem.FileSystem.create_stream
    write_text = Path.write_text

    def full(path: object) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def stream(self: Any, path: Any, mode: str) -> Any:
        if target in str(path) and str(path).endswith(".distcp") and disk.kind != "text":
            if disk.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise full(path)
        return create_stream(self, path, mode)

    def text(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if disk.kind == "text" and self.parent.name == target and self.name == "data_state.json":
            raise full(self)
        return write_text(self, data, *args, **kwargs)

    filesystem.FileSystem.create_stream = stream  # type: ignore[method-assign]
    Path.write_text = text  # type: ignore[method-assign]
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
        Path.write_text = write_text  # type: ignore[method-assign]


def _train(argv: list[str], poison: Poison | None = None, disk: Disk | None = None) -> Outcome:
    """``torchrun ... -m hp_train *argv`` on this rank of the pool, faults injected; the
    error a fault raised (on every rank) is returned, as the exit code would say it."""
    runtime = init_runtime("cpu", threads=1)
    trainer = None
    try:
        model, parallel, config, options, _ = parse(argv, runtime.world_size)
        trainer = Trainer(model, parallel, config, options, runtime)
        if poison is not None:
            _poison(trainer, poison)
        with _failing_disk(disk):
            summary = trainer.run()
    except (NonFiniteError, CheckpointError, ConfigError) as exc:
        skipped = [] if trainer is None else trainer.skipped
        return Outcome(error=type(exc).__name__, message=str(exc), skipped=skipped)
    states = [s for s in trainer.optimizer.state.values() if "step" in s]
    return Outcome(
        first_step=summary.first_step,
        skipped=summary.skipped_steps,
        adam_steps=int(states[0]["step"]) if states else None,
        losses=summary.losses,
    )


def _pool(
    nproc: int, out: Path, *extra: str, poison: Poison | None = None, disk: Disk | None = None
) -> Outcome:
    """:func:`_train` on ``nproc`` ranks; every rank must have the same outcome."""
    outcomes = run_on_ranks(
        nproc, _train, [*SHORT, "--out", str(out), *extra], poison, disk, timeout=300
    )
    assert all(o.error == outcomes[0].error for o in outcomes), outcomes
    assert all(o.message == outcomes[0].message for o in outcomes), outcomes
    return outcomes[0]


def _log(out: Path, rank: int = 0) -> str:
    return (out / "logs" / f"rank_{rank}.log").read_text()


def _step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:06d}"


# ------------------------------------------------------------------------ non-finite
@pytest.mark.multiprocess
def test_nan_lr_stops_every_rank_before_the_step_under_torchrun(tmp_path: Path) -> None:
    """``--lr 1e6`` under torchrun (world 2, FSDP, AdamW, a checkpoint after every step):
    the job exits non-zero, ranks with exit code 3 (or stopped by torchrun after the first
    left), rank 0's stderr and every rank's log name the step and the first non-finite
    gradient; no checkpoint of a later step exists and
    every checkpoint's tensors are finite."""
    out = tmp_path / "lr"
    extra = ["--tp", "1", "--lr", "1e6", "--optimizer", "adamw", "--checkpoint-every", "1"]
    done = subprocess.run(
        _command(2, out, *extra), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    # Every rank stops with the error; the first to exit gives its code, and torchrun may
    # have stopped the other one (SIGTERM) by the time that one leaves its teardown.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)
    assert f"{EXIT_NONFINITE}" in codes, done.stderr[-3000:]
    assert set(codes) <= {f"{EXIT_NONFINITE}", f"-{signal.SIGTERM.value}"}, codes
    records = read_metrics(out / "metrics.jsonl")
    stopped = int(str(records[-1]["step"]))  # 1-based: the step that stopped the run
    latest = _step_dir(out, stopped - 1)
    _expect("nan-lr", done.stderr, n=stopped, checkpoint=latest)
    for rank in (0, 1):
        _expect("nan-lr", _log(out, rank), n=stopped, checkpoint=latest)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"step_{s:06d}" for s in range(1, stopped)
    ]
    state = checkpoint_state(latest, tmp_path / "latest.pt")
    tensors = [t for t in _leaves(state) if t.is_floating_point()]
    assert tensors
    assert all(bool(torch.isfinite(t).all()) for t in tensors)


def _leaves(state: object) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _leaves(value)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("nproc", "dims", "poison"),
    [
        (2, ("--tp", "1"), Poison(rank=1, steps=(1,))),
        (4, ("--dp-shard", "2", "--tp", "2"), Poison(3, (1,), "layers.1.ffn.w3.weight")),
        # Stage 0 of 2 has no loss; its gradient counts as much as the last stage's.
        (2, ("--tp", "1", "--pp", "2"), Poison(rank=0, steps=(1,), name="layers.0.ffn.w2.weight")),
    ],
    ids=["fsdp-w2", "fsdp-tp-w4", "pp-stage0-w2"],
)
def test_nan_in_one_ranks_gradient_stops_naming_it(
    nproc: int, dims: tuple[str, ...], poison: Poison, tmp_path: Path
) -> None:
    got = _pool(nproc, tmp_path, *dims, poison=poison)
    assert got.error == "NonFiniteError"
    # The messages count steps from 1, as the step lines and metrics.jsonl do.
    _expect("nan-grad", got.message, n=2, name=poison.name, r=poison.rank)
    _expect("nan-grad", _log(tmp_path, poison.rank), n=2, name=poison.name, r=poison.rank)
    assert not (tmp_path / "checkpoints").exists()  # stopped at step 1, before any save


@pytest.mark.multiprocess
def test_nan_loss_in_one_micro_step_stops(tmp_path: Path) -> None:
    poison = Poison(rank=1, steps=(2,), name="tok_embeddings.weight", what="loss")
    got = _pool(2, tmp_path, "--tp", "1", "--grad-accum", "2", poison=poison)
    assert got.error == "NonFiniteError"
    _expect("nan-loss-accum", got.message, n=3, name="tok_embeddings.weight")
    assert not _step_dir(tmp_path, 4).exists()
    assert _step_dir(tmp_path, 2).is_dir()


@pytest.mark.multiprocess
def test_skip_nonfinite_skips_counts_and_gives_up(tmp_path: Path) -> None:
    """``--skip-nonfinite 2`` and a NaN loss on rank 1 at steps 1 and 3 (AdamW): both steps
    are skipped (the optimizer stepped 2 times in 4 steps), marked in their records and in
    the summary, said once each (no divergence warning for the NaN rank at the monitored step
    3), and the run ends normally; with ``--skip-nonfinite 1`` the second one stops it."""
    extra = ("--tp", "1", "--optimizer", "adamw", "--skip-nonfinite")
    poison = Poison(rank=1, steps=(1, 3), what="loss")
    got = _pool(2, tmp_path / "two", *extra, "2", poison=poison)
    assert got.error is None, got.message
    assert got.skipped == [1, 3]
    assert got.adam_steps == 2
    records = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, True, False, True]
    assert [r.get("skipped_steps") for r in records if r.get("skipped")] == [1, 2]
    assert all(math.isfinite(float(str(r["loss"]))) for r in records if not r.get("skipped"))
    log = _log(tmp_path / "two")
    _expect("skip", log, n=2, i=1, limit=2)
    _expect("skip", log, n=4, i=2, limit=2)
    rank_losses = records[3]["rank_losses"]
    assert isinstance(rank_losses, list)
    assert rank_losses[1] is None  # rank 1's loss was NaN at the monitored step 3
    assert "diverges" not in log  # the skip is said once, not as a divergence per rank
    saved = json.loads((_step_dir(tmp_path / "two", 4) / "skipped_steps.json").read_text())
    assert saved == {"skipped_steps": [1, 3]}

    got = _pool(2, tmp_path / "one", *extra, "1", poison=poison)
    assert got.error == "NonFiniteError"
    _expect("skip-exceeded", got.message, n=4, limit=1, steps=[2])


@pytest.mark.multiprocess
def test_nonfinite_weights_are_never_saved(tmp_path: Path) -> None:
    """A weight made NaN after step 3's optimizer step: the save after it refuses, naming the
    parameter, and writes nothing; the checkpoint of step 2 stays the latest."""
    poison = Poison(rank=0, steps=(3,), name="layers.1.ffn.w1.weight", what="parameter")
    got = _pool(2, tmp_path, "--tp", "1", poison=poison)
    assert got.error == "NonFiniteError"
    _expect("nan-weights", got.message, n=4, name=poison.name, r=0, step="000004")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.multiprocess
def test_resume_after_a_nonfinite_stop_continues_from_the_last_finite_checkpoint(
    tmp_path: Path,
) -> None:
    """NaN gradients at step 5 of 6 (checkpoints after 2 and 4) stop the run; ``--resume``
    without the fault starts at 4 and its step 4 has the first run's loss bit for bit."""
    extra = ("--tp", "1", "--steps", "6")
    got = _pool(2, tmp_path, *extra, poison=Poison(rank=0, steps=(5,)))
    assert got.error == "NonFiniteError"
    # Summary.losses are by 0-based step, metrics.jsonl's records 1-based.
    first = {int(str(r["step"])) - 1: r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    resumed = _pool(2, tmp_path, *extra, "--resume")
    assert resumed.first_step == 4
    assert sorted(resumed.losses) == [4, 5]
    assert resumed.losses[4] == first[4]
    _expect("resume-after-nan", _log(tmp_path), checkpoint=_step_dir(tmp_path, 4), n=4)


def test_negative_skip_nonfinite_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError) as raised:
        TrainConfig(skip_nonfinite=-1)
    _expect("skip-negative", str(raised.value))
    assert parse(["--skip-nonfinite", "3"], 1)[2].skip_nonfinite == 3


# ------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world-2 run (tp 2) with checkpoints after steps 2 and 4, each with a manifest."""
    out = tmp_path_factory.mktemp("saved")
    assert _pool(2, out).first_step == 0
    for step in (2, 4):
        manifest = json.loads((_step_dir(out, step) / MANIFEST_FILE).read_text())
        assert ".metadata" in manifest["files"]
        assert "__1_0.distcp" in manifest["files"]
        assert "data_state.json" in manifest["files"]
    return out


def _copy(saved: Path, out: Path) -> Path:
    shutil.copytree(saved / "checkpoints", out / "checkpoints")
    return _step_dir(out, 4)


def _truncate(d: Path) -> dict[str, object]:
    file = d / "__1_0.distcp"
    size = file.stat().st_size
    with file.open("r+b") as f:
        f.truncate(size // 2)
    return {"file": "__1_0", "n": size // 2, "m": size}


def _delete(d: Path) -> dict[str, object]:
    (d / "__0_0.distcp").unlink()
    return {"file": "__0_0"}


def _overwrite(d: Path) -> dict[str, object]:
    file = d / "__0_0.distcp"
    with file.open("r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(b"\0" * 64)
    return {"file": "__0_0"}


def _empty_metadata(d: Path) -> dict[str, object]:
    (d / ".metadata").write_bytes(b"")
    return {}


def _data_state(d: Path) -> dict[str, object]:
    size = (d / "data_state.json").stat().st_size
    (d / "data_state.json").write_text("{}")
    return {"n": 2, "m": size}


def _manifest(d: Path) -> dict[str, object]:
    (d / MANIFEST_FILE).write_text('{"version": 1, "files": ')
    return {}


def _overwrite_4k(file: Path, at: int) -> None:
    with file.open("r+b") as f:
        f.seek(at)
        f.write(b"\xa5" * 4096)


def _no_manifest_bit_flipped(d: Path) -> dict[str, object]:
    """The manifest deleted, then one bit of a tensor file flipped: the load itself would
    succeed (a value changes)."""
    (d / MANIFEST_FILE).unlink()
    file = d / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))
    return {}


def _no_manifest_4k_overwritten(d: Path) -> dict[str, object]:
    """The manifest deleted, then 4 KiB of a tensor file overwritten from its start (torch's
    load would fail)."""
    (d / MANIFEST_FILE).unlink()
    _overwrite_4k(d / "__0_0.distcp", 0)
    return {}


def _as_old_checkpoint(d: Path) -> None:
    """Make ``d`` what an hp-train from before manifests wrote: no manifest, no format
    marker in ``.metadata`` (torch's DCP pickles it)."""
    (d / MANIFEST_FILE).unlink()
    file = d / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    metadata.state_dict_metadata = {
        k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(FORMAT_KEY)
    }
    metadata.storage_data = {
        k: v for k, v in metadata.storage_data.items() if not k.fqn.startswith(FORMAT_KEY)
    }
    if isinstance(metadata.planner_data, dict):
        metadata.planner_data = {
            k: v for k, v in metadata.planner_data.items() if not k.startswith(FORMAT_KEY)
        }
    file.write_bytes(pickle.dumps(metadata))


def _old_unmarked(d: Path) -> dict[str, object]:
    _as_old_checkpoint(d)
    return {}


def _old_marked_4k_overwritten(d: Path) -> dict[str, object]:
    """An old checkpoint, marked: it passes the structural check, then 4 KiB of a tensor file
    are overwritten from its start, which torch's load cannot read."""
    _as_old_checkpoint(d)
    assert checkpoint_command(["mark-legacy", str(d)]) == 0
    _overwrite_4k(d / "__0_0.distcp", 0)
    return {}


#: Each damage by its test id: the case whose message it gives, what damages the checkpoint.
CORRUPTIONS: dict[str, tuple[str, Callable[[Path], dict[str, object]]]] = {
    "truncated": ("truncated", _truncate),
    "deleted": ("deleted", _delete),
    "overwritten": ("overwritten", _overwrite),
    "empty-metadata": ("empty-metadata", _empty_metadata),
    "data-state": ("data-state", _data_state),
    "manifest": ("manifest", _manifest),
    "no-manifest-bit-flip": ("manifest-deleted", _no_manifest_bit_flipped),
    "no-manifest-4k": ("manifest-deleted", _no_manifest_4k_overwritten),
    "old-unmarked": ("legacy-unmarked", _old_unmarked),
    "old-marked-4k": ("load-fails", _old_marked_4k_overwritten),
}


def _logged_losses(out: Path) -> dict[int, float]:
    return {int(str(r["step"])): float(str(r["loss"])) for r in read_metrics(out / "metrics.jsonl")}


def _after_step_2(saved: Path) -> dict[int, float]:
    """The losses of steps 2 and 3 of the uninterrupted run: what a run resumed from its
    step-2 checkpoint must repeat bit for bit (step 3's depends on the optimizer state too)."""
    losses = _logged_losses(saved)
    return {2: losses[3], 3: losses[4]}  # Summary's 0-based steps, metrics.jsonl's 1-based


@pytest.mark.multiprocess
@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_resume_skips_a_corrupt_checkpoint(damage: str, saved: Path, tmp_path: Path) -> None:
    """The newest checkpoint damaged: ``--resume`` says which file of which checkpoint is
    wrong (or that it did not load) and starts from the one before, on every rank; the steps
    it runs have the uninterrupted run's losses bit for bit."""
    key, corrupt = CORRUPTIONS[damage]
    latest = _copy(saved, tmp_path)
    values = corrupt(latest)
    got = _pool(2, tmp_path, "--resume")
    assert got.error is None, got.message
    assert got.first_step == 2
    assert got.losses == _after_step_2(saved)
    _expect(key, _log(tmp_path), checkpoint=latest, **values)
    _expect(key, _log(tmp_path, 1), checkpoint=latest, **values)


@pytest.mark.multiprocess
def test_resume_at_world_4_skips_a_checkpoint_saved_at_world_2(saved: Path, tmp_path: Path) -> None:
    """Four ranks share the verification of a checkpoint two ranks wrote."""
    latest = _copy(saved, tmp_path)
    values = _truncate(latest)
    got = _pool(4, tmp_path, "--dp-shard", "2", "--steps", "3", "--resume")
    assert got.first_step == 2, got.message
    _expect("truncated", _log(tmp_path, 3), checkpoint=latest, **values)


@pytest.mark.multiprocess
def test_resume_from_picks_one_checkpoint(saved: Path, tmp_path: Path) -> None:
    """``--resume-from`` an older checkpoint takes it although a newer one verifies; a
    damaged, missing or folder argument is an error naming it; so is a checkpoint of this
    version whose manifest was deleted, which ``mark-legacy`` refuses to mark as old."""
    latest = _copy(saved, tmp_path)
    older = _step_dir(tmp_path, 2)
    assert _pool(2, tmp_path, "--steps", "3", "--resume-from", str(older)).first_step == 2

    _delete(latest)
    got = _pool(2, tmp_path, "--resume-from", str(latest))
    assert got.error == "CheckpointCorruptError"
    _expect("resume-from-corrupt", got.message, checkpoint=latest, problem="__0_0.distcp: missing")

    got = _pool(2, tmp_path, "--resume-from", str(tmp_path / "nowhere"))
    assert got.error == "ConfigError"
    _expect("resume-from-missing", got.message, dir=tmp_path / "nowhere")

    got = _pool(2, tmp_path, "--resume-from", str(tmp_path / "checkpoints"))
    assert got.error == "ConfigError"
    _expect("resume-from-folder", got.message, dir=tmp_path / "checkpoints", checkpoint=latest)

    # Its manifest deleted: refused, and it cannot be marked as an old checkpoint.
    (older / MANIFEST_FILE).unlink()
    got = _pool(2, tmp_path, "--steps", "3", "--resume-from", str(older))
    assert got.error == "CheckpointCorruptError"
    assert got.message.startswith(f"--resume-from {older} does not verify: manifest.json: missing")
    assert "holds the format marker hp_train_format" in got.message
    assert checkpoint_command(["mark-legacy", str(older)]) == 2
    assert not (older / LEGACY_MARK).exists()


def test_an_old_checkpoint_loads_only_once_marked(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint as an hp-train before manifests wrote it (no manifest, no format marker):
    ``--resume-from`` refuses it saying how to mark it; ``mark-legacy`` marks it (and refuses a
    checkpoint with a manifest); then it loads, with a warning."""
    older = _step_dir(tmp_path, 2)
    shutil.copytree(_step_dir(saved, 2), older)
    assert checkpoint_command(["mark-legacy", str(older)]) == 2
    assert f"{older} has a manifest.json" in capsys.readouterr().err
    _as_old_checkpoint(older)
    got = _pool(2, tmp_path, "--steps", "3", "--resume-from", str(older))
    assert got.error == "CheckpointCorruptError"
    assert got.message.startswith(f"--resume-from {older} does not verify: manifest.json: missing")
    assert f"mark it with: python -m hp_train.checkpoint mark-legacy {older}" in got.message
    assert checkpoint_command(["mark-legacy", str(older)]) == 0
    assert (older / LEGACY_MARK).is_file()
    got = _pool(2, tmp_path, "--resume-from", str(older))
    assert got.first_step == 2, got.message
    assert got.losses == _after_step_2(saved)
    _expect("legacy", _log(tmp_path), checkpoint=older)


def test_nothing_verifies_exits_4_naming_each_checkpoint(saved: Path, tmp_path: Path) -> None:
    """One process (no torchrun): every checkpoint damaged is exit code 4 and a message that
    names each checkpoint and its bad file; no step runs."""
    latest = _copy(saved, tmp_path)
    _truncate(latest)
    _empty_metadata(_step_dir(tmp_path, 2))
    done = subprocess.run(
        [sys.executable, "-m", "hp_train", *SHORT, "--tp", "1", "--out", str(tmp_path), "--resume"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == EXIT_CHECKPOINT, done.stderr[-3000:]
    _expect("none-verifies", done.stderr, dir=tmp_path / "checkpoints")
    assert f"{latest}: __1_0.distcp:" in done.stderr
    assert f"{_step_dir(tmp_path, 2)}: empty .metadata" in done.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def _load_fails_on_rank_1(argv: list[str], newest: str) -> Outcome:
    """:func:`_train` where torch's load of ``newest`` fails on rank 1 alone, after reading
    every byte on both ranks (rank 0's model then holds ``newest``'s weights)."""
    from hp_train.checkpoint import dcp

    real = getattr(dcp, "dcp_load")  # noqa: B009 - not exported: torch's load, as dcp uses it

    def load(state: dict[str, Any], checkpoint_id: str) -> None:
        real(state, checkpoint_id=checkpoint_id)
        if dist.get_rank() == 1 and Path(checkpoint_id).name == newest:
            error = OSError(errno.EIO, "injected read error")
            raise CheckpointException("load", {1: (error, traceback.StackSummary())})

    setattr(dcp, "dcp_load", load)  # noqa: B010
    try:
        return _train(argv)
    finally:
        setattr(dcp, "dcp_load", real)  # noqa: B010


@pytest.mark.multiprocess
def test_a_load_failing_on_one_rank_falls_back_on_every_rank(saved: Path, tmp_path: Path) -> None:
    """The newest checkpoint verifies, but its load fails on rank 1 only: every rank skips it
    (the ranks agree in one gather) and loads the one before whole, so the steps run have
    the uninterrupted run's losses bit for bit (rank 0 had read the newest one's tensors,
    in place)."""
    latest = _copy(saved, tmp_path)
    argv = [*SHORT, "--out", str(tmp_path), "--resume"]
    outcomes = run_on_ranks(2, _load_fails_on_rank_1, argv, latest.name, timeout=60)
    assert [(o.error, o.first_step) for o in outcomes] == [(None, 2), (None, 2)], outcomes
    assert outcomes[0].losses == _after_step_2(saved)
    for rank in (0, 1):
        error = "OSError: [Errno 5] injected read error"
        _expect("load-fails", _log(tmp_path, rank), checkpoint=latest, r=1, error=error)


@pytest.mark.multiprocess
def test_resume_with_nothing_to_resume_is_an_error_unless_asked(tmp_path: Path) -> None:
    """``--resume`` with no checkpoint: a configuration error naming the folder, no step run;
    ``--resume-if-present`` starts a new run instead, and resumes like ``--resume`` once a
    checkpoint is there."""
    got = _pool(2, tmp_path / "none", "--resume")
    assert got.error == "ConfigError"
    _expect("resume-nothing", got.message, dir=tmp_path / "none" / "checkpoints")
    assert not (tmp_path / "none" / "metrics.jsonl").exists()

    fresh = tmp_path / "fresh"
    (fresh / "metrics.jsonl").parent.mkdir()
    (fresh / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')  # a run gone before a save
    got = _pool(2, fresh, "--resume-if-present", "--steps", "2")
    assert (got.error, got.first_step) == (None, 0), got.message
    _expect("resume-if-present", _log(fresh), dir=fresh / "checkpoints")
    assert sorted(_logged_losses(fresh)) == [1, 2]  # a new run's records only
    assert _pool(2, fresh, "--resume-if-present").first_step == 2


def test_resume_if_present_is_read_from_a_config_file_and_never_written(tmp_path: Path) -> None:
    """``[run] resume_if_present = true`` in a ``--config`` file sets it, as ``resume`` is
    set; like ``resume``, the written configuration leaves it out (it says what to do, not
    what the run is)."""
    config = tmp_path / "run.toml"
    config.write_text("[run]\nresume_if_present = true\n")
    options = parse(["--config", str(config)], 1)[3]
    assert options.resume_if_present
    assert not parse([], 1)[3].resume_if_present
    assert options.options is not None
    assert "resume_if_present" not in options.options["run"]
    assert "resume" not in options.options["run"]


@pytest.mark.multiprocess
def test_resume_with_only_a_partial_checkpoint_exits_2_naming_it(tmp_path: Path) -> None:
    """Under torchrun at world 2: only ``step_000004.partial`` in the folder; every rank exits
    with code 2 and the job prints one line naming the folder and the partial save."""
    partial = tmp_path / "checkpoints" / "step_000004.partial"
    partial.mkdir(parents=True)
    done = subprocess.run(
        _command(2, tmp_path, "--resume"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)
    assert "2" in codes, done.stderr[-3000:]
    assert set(codes) <= {"2", f"-{signal.SIGTERM.value}"}, codes
    lines = [line for line in done.stderr.splitlines() if line.startswith("hp-train:")]
    assert len(lines) == 1, done.stderr[-3000:]
    _expect("resume-partial", lines[0], dir=tmp_path / "checkpoints", partial=partial.name)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "disk",
    [Disk(rank=1, step=4), Disk(rank=0, step=4, kind="text")],
    ids=["rank1-data", "rank0-text"],
)
def test_disk_full_while_saving(disk: Disk, tmp_path: Path) -> None:
    """ENOSPC on one rank while the second checkpoint is written: every rank raises the same
    error (none hangs in a barrier), the checkpoint stays ``.partial``, and ``--resume``
    continues from the first."""
    got = _pool(2, tmp_path, "--tp", "1", disk=disk)
    assert got.error == "CheckpointWriteError"
    partial = tmp_path / "checkpoints" / "step_000004.partial"
    _expect("disk-full", got.message, dir=partial, r=disk.rank)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004.partial",
    ]
    assert _pool(2, tmp_path, "--tp", "1", "--resume").first_step == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004",
    ]


@pytest.mark.multiprocess
def test_rank_killed_while_saving(tmp_path: Path) -> None:
    """Rank 1 dies (SIGKILL) in the middle of writing the second checkpoint: only
    ``step_000004.partial`` is left, ``--resume`` continues from step 2, and its save of step
    4 replaces the partial one. (Last: the pool restarts its ranks after the kill.)"""
    with pytest.raises(RankFailure):
        _pool(2, tmp_path, "--tp", "1", disk=Disk(rank=1, step=4, kind="kill"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000004.partial",
    ]
    assert _pool(2, tmp_path, "--tp", "1", "--resume").first_step == 2
    _expect("kill-save", _log(tmp_path), checkpoint=_step_dir(tmp_path, 2), n=2)
    assert (_step_dir(tmp_path, 4) / MANIFEST_FILE).is_file()
    assert not (tmp_path / "checkpoints" / "step_000004.partial").exists()
