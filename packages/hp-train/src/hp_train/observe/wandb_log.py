"""Weights & Biases runs of a run's scalars, offline (the optional extra ``hp-train[wandb]``).

:func:`open_wandb` starts a W&B run in offline mode: nothing is sent anywhere while training;
the run's records go to ``<out_dir>/wandb/offline-run-<time>-<id>/``, and
``wandb sync <out_dir>/wandb/offline-run-*`` uploads them later, from any machine with network
and a W&B login. The scalars and their tags are TensorBoard's
(:mod:`hp_train.observe.tensorboard`), logged at the same steps, so both trackers show the
same charts. Open one run per training run, on rank 0 (the values are already global).

A resumed run (``resume_step``) continues the W&B run of the interrupted one: the run id is
kept in ``<out_dir>/wandb/run_id``, each invocation writes its own offline folder under that id,
and syncing them all appends to one run. W&B keeps one value per step and step numbers only
grow: the steps a resumed run repeats (after the checkpoint it resumes from, up to where the
interrupted one stopped) keep the interrupted run's values when synced in order.

:func:`check_wandb_available` is the cheap check for the command line to call before
anything slow: a run that asks for W&B without the package fails at once with a
:class:`~hp_train.config.schema.ConfigError` naming the extra.
"""

from __future__ import annotations

import importlib.util
import math
import secrets
import string
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any

from hp_train.config.schema import ConfigError
from hp_train.observe.tensorboard import LR_PREFIX, SCALAR_TAGS, lr_tag

__all__ = [
    "MISSING_WANDB",
    "RUN_ID_FILE",
    "WandbLog",
    "check_wandb_available",
    "open_wandb",
]

#: The error a run gets when it asks for W&B and the package is missing.
MISSING_WANDB = "Weights & Biases needs pip install 'hp-train[wandb]'"

#: The file under ``<out_dir>/wandb`` holding the W&B run id (kept for resumed runs).
RUN_ID_FILE = "run_id"

_ID_CHARS = string.ascii_lowercase + string.digits


def check_wandb_available() -> None:
    """Return when the ``wandb`` package is installed (found, not imported: this is cheap).

    Raises:
        ConfigError: :data:`MISSING_WANDB`, when it is not.
    """
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{MISSING_WANDB} (the run asked for --wandb)")


def _check_tag(tag: str) -> None:
    if tag in SCALAR_TAGS:
        return
    if isinstance(tag, str) and tag.startswith(LR_PREFIX):
        lr_tag(tag[len(LR_PREFIX) :])
        return
    known = ", ".join([*SCALAR_TAGS, LR_PREFIX + "<group>"])
    raise ValueError(f"unknown W&B tag {tag!r}; the tags are TensorBoard's: {known}")


def _plain(value: object) -> object:
    """``value`` as JSON-like data W&B stores as it is (paths and other objects as text)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, PathLike):
        return str(Path(value))
    return str(value)


class WandbLog:
    """An open offline W&B run; build it with :func:`open_wandb`.

    Attributes:
        run_dir: the run's offline folder (what ``wandb sync`` takes).
        run_id: its W&B run id.

    Also a context manager (:meth:`close` on exit).
    """

    def __init__(self, run: Any, run_dir: Path, run_id: str) -> None:
        self._run: Any | None = run
        self.run_dir = run_dir
        self.run_id = run_id
        self._last_step: int | None = None

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Log each ``tag -> value`` of ``values`` at ``step``, as one W&B history row.

        None and non-finite values are skipped (as in TensorBoard; ``metrics.jsonl`` names
        them). Every tag and value is checked before anything is logged. Logging the same step
        again adds to its row.

        Raises:
            ValueError: ``step`` not a non-negative int or below a step logged before (W&B
                would drop the row), a tag that is not TensorBoard's, or the run was closed.
            TypeError: a value that is not a number.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step < self._last_step:
            raise ValueError(
                f"W&B steps only grow: step {step} after step {self._last_step} would be dropped"
            )
        row: dict[str, float] = {}
        for tag, value in values.items():
            _check_tag(tag)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"W&B value of {tag!r} must be a number, got {value!r}")
            if math.isfinite(value):
                row[tag] = float(value)
        run = self._open_run()
        self._last_step = step
        if row:
            run.log(row, step=step)

    def close(self) -> None:
        """Finish the run and stop W&B in this process; calling it again does nothing.

        Postcondition: the run's records are complete on disk (W&B's service process closes
        a run's file only when it stops, so it is stopped here: a W&B run opened elsewhere in
        the process would end with it; the trainer opens none).
        """
        if self._run is not None:
            run, self._run = self._run, None
            import wandb

            run.finish()
            wandb.teardown()

    def _open_run(self) -> Any:
        if self._run is None:
            raise ValueError(f"the W&B run {self.run_dir} is closed")
        return self._run

    def __enter__(self) -> WandbLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _run_id(folder: Path, resumed: bool) -> str:
    """The kept run id for a resumed run (when there is one), else a new one, kept."""
    path = folder / RUN_ID_FILE
    if resumed and path.is_file():
        kept = path.read_text().strip()
        if kept and all(c in _ID_CHARS for c in kept):
            return kept
        raise ConfigError(
            f"{path} should hold a W&B run id (lowercase letters and digits), got {kept!r}; "
            "delete it to start a new W&B run"
        )
    new = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(new + "\n")
    return new


def open_wandb(
    out_dir: Path,
    *,
    project: str,
    run_name: str,
    config: Mapping[str, object],
    resume_step: int | None,
) -> WandbLog:
    """A new offline W&B run under ``<out_dir>/wandb`` for :meth:`WandbLog.scalars`.

    ``config`` (the run's options) is stored as the run's config, with ``resume_step`` added;
    ``resume_step``: None or 0 for a new run, else the step a resumed run starts from (it
    continues the kept run id, see the module docstring).

    Postcondition: :attr:`WandbLog.run_dir` exists and W&B writes nothing outside
    ``<out_dir>/wandb``; the console output of the process is not captured.

    Raises:
        ConfigError: :data:`MISSING_WANDB`, when ``wandb`` is not importable; or a kept run id
            file that holds no id.
        ValueError: ``project`` or ``run_name`` not a non-empty str, or ``resume_step`` not
            None or a non-negative int.
    """
    for name, text in (("project", project), ("run_name", run_name)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"the W&B {name} must be a non-empty str, got {text!r}")
    if resume_step is not None and (
        isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0
    ):
        raise ValueError(f"resume_step must be None or a non-negative int, got {resume_step!r}")
    check_wandb_available()
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(f"{MISSING_WANDB} (wandb failed to import: {exc})") from exc
    out = Path(out_dir)
    resumed = bool(resume_step)
    run_id = _run_id(out / "wandb", resumed)
    run = wandb.init(
        project=project,
        name=run_name,
        id=run_id,
        resume="allow" if resumed else None,
        dir=str(out),
        mode="offline",
        config={
            **{str(k): _plain(v) for k, v in config.items()},
            "resume_step": resume_step or 0,
        },
        # The trainer prints and logs on its own; W&B would wrap stdout and stderr.
        settings=wandb.Settings(console="off", quiet=True),
    )
    return WandbLog(run, Path(run.dir).parent, run_id)
