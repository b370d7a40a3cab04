"""TensorBoard event files of a run's scalars (the optional extra ``hp-train[tensorboard]``).

:func:`open_tensorboard` gives a :class:`TensorBoardLog` writing through
``torch.utils.tensorboard.SummaryWriter``; a run that asks for TensorBoard without the package
fails at once with a :class:`~hp_train.config.schema.ConfigError` rather than training without it.
Open one log per run, on rank 0: the values written are already global (reduced over ranks).

The tags, shared by the trainer (which writes them) and the tests (which read them back):

======================  ========================================================================
tag                     value
======================  ========================================================================
``train/loss``          loss of the step over the global batch
``train/moe_aux_loss``  the mixture-of-experts load-balancing loss of the step (MoE models)
``eval/loss``           mean loss over the evaluation batches
``eval/perplexity``     ``exp(eval/loss)``
``optim/lr/<group>``    learning rate of one optimizer group (:func:`lr_tag`), e.g. ``muon``
``optim/grad_norm``     global gradient norm before the optimizer step
``perf/tokens_per_s``   tokens of the global batch per second of the step
``perf/step_time_s``    wall time of the step in seconds
``perf/mfu``            model FLOPs utilization (a fraction; :mod:`hp_train.observe.flops`)
``memory/peak_rss_mib`` CPU: the process's peak resident set in MiB, the largest over the
                        ranks (:func:`peak_mib`)
``memory/peak_allocated_mib``  accelerators: the peak memory occupied by tensors in MiB, the
                        largest over the ranks
======================  ========================================================================

Values are stored as TensorBoard scalars (32-bit floats), at the step given to
:meth:`TensorBoardLog.scalars`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING

from hp_train.config.schema import ConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = [
    "EVAL_LOSS",
    "EVAL_PERPLEXITY",
    "GRAD_NORM",
    "LR_PREFIX",
    "MEMORY_TAGS",
    "MFU",
    "MISSING_TENSORBOARD",
    "MOE_AUX_LOSS",
    "PEAK_ALLOCATED_MIB",
    "PEAK_RSS_MIB",
    "SCALAR_TAGS",
    "STEP_TIME_S",
    "TOKENS_PER_S",
    "TRAIN_LOSS",
    "TensorBoardLog",
    "lr_tag",
    "open_tensorboard",
    "peak_mib",
]

TRAIN_LOSS = "train/loss"
MOE_AUX_LOSS = "train/moe_aux_loss"
EVAL_LOSS = "eval/loss"
EVAL_PERPLEXITY = "eval/perplexity"
LR_PREFIX = "optim/lr/"
GRAD_NORM = "optim/grad_norm"
TOKENS_PER_S = "perf/tokens_per_s"
STEP_TIME_S = "perf/step_time_s"
MFU = "perf/mfu"
PEAK_RSS_MIB = "memory/peak_rss_mib"
PEAK_ALLOCATED_MIB = "memory/peak_allocated_mib"
#: The memory tag of each metrics record key of :data:`hp_train.observe.metrics.MEMORY_LABELS`.
MEMORY_TAGS: Mapping[str, str] = MappingProxyType(
    {"peak_rss_bytes": PEAK_RSS_MIB, "peak_allocated_bytes": PEAK_ALLOCATED_MIB}
)

#: Every fixed tag -> what it holds (the learning rates are ``LR_PREFIX + group``).
SCALAR_TAGS: Mapping[str, str] = MappingProxyType(
    {
        TRAIN_LOSS: "loss of the step over the global batch",
        MOE_AUX_LOSS: "mixture-of-experts load-balancing loss of the step",
        EVAL_LOSS: "mean loss over the evaluation batches",
        EVAL_PERPLEXITY: "exp(eval/loss)",
        GRAD_NORM: "global gradient norm before the optimizer step",
        TOKENS_PER_S: "tokens of the global batch per second of the step",
        STEP_TIME_S: "wall time of the step in seconds",
        MFU: "model FLOPs utilization of the step (a fraction)",
        PEAK_RSS_MIB: "CPU: peak resident set of the process in MiB, the largest over the ranks",
        PEAK_ALLOCATED_MIB: "peak memory occupied by tensors in MiB, the largest over the ranks",
    }
)

#: The error a run gets when it asks for TensorBoard and the package is missing.
MISSING_TENSORBOARD = "TensorBoard needs pip install 'hp-train[tensorboard]'"


def lr_tag(group: str) -> str:
    """The tag of one optimizer group's learning rate: ``"optim/lr/<group>"``.

    Raises:
        ValueError: ``group`` empty or containing ``/`` (it would nest another level).
    """
    if not isinstance(group, str) or not group or "/" in group:
        raise ValueError(
            f"an optimizer group name must be a non-empty str without '/', got {group!r}"
        )
    return LR_PREFIX + group


def peak_mib(per_rank_bytes: Sequence[int | None]) -> float | None:
    """The largest of the ranks' peak memory, in MiB; None when no rank measured one.

    ``per_rank_bytes`` is what :func:`hp_train.observe.metrics.peak_memory_bytes` gave on each rank
    (None where the device keeps no statistics).
    """
    measured = [b for b in per_rank_bytes if b is not None]
    return max(measured) / 2**20 if measured else None


def _check_tag(tag: str) -> None:
    if tag in SCALAR_TAGS:
        return
    if isinstance(tag, str) and tag.startswith(LR_PREFIX):
        lr_tag(tag[len(LR_PREFIX) :])
        return
    known = ", ".join([*SCALAR_TAGS, LR_PREFIX + "<group>"])
    raise ValueError(f"unknown TensorBoard tag {tag!r}; the tags are {known}")


class TensorBoardLog:
    """An open TensorBoard event log; build it with :func:`open_tensorboard`.

    Also a context manager (:meth:`close` on exit).
    """

    def __init__(self, writer: SummaryWriter, log_dir: Path) -> None:
        self._writer: SummaryWriter | None = writer
        self.log_dir = log_dir

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Write each ``tag -> value`` of ``values`` at ``step``.

        None and non-finite values are skipped (TensorBoard would draw a NaN as a gap anyway,
        and an inf flattens the chart; ``metrics.jsonl`` names them). Every tag is checked
        before anything is written. Events reach the file by :meth:`flush`, :meth:`close`,
        or the writer's own queue (10 events or 120 s).

        Raises:
            ValueError: ``step`` not a non-negative int, a tag that is not in the table of the
                module docstring, or the log was closed.
            TypeError: a value that is not a number.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        numbers: list[tuple[str, float]] = []
        for tag, value in values.items():
            _check_tag(tag)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"TensorBoard value of {tag!r} must be a number, got {value!r}")
            if math.isfinite(value):
                numbers.append((tag, float(value)))
        writer = self._open_writer()
        for tag, number in numbers:
            writer.add_scalar(tag, number, global_step=step)

    def flush(self) -> None:
        """Write the queued events to the event file now."""
        self._open_writer().flush()

    def close(self) -> None:
        """Flush and close the event file; calling it again does nothing."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open_writer(self) -> SummaryWriter:
        if self._writer is None:
            raise ValueError(f"the TensorBoard log {self.log_dir} is closed")
        return self._writer

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_tensorboard(log_dir: str | Path, *, purge_step: int | None = None) -> TensorBoardLog:
    """A new event file in ``log_dir`` (created if missing) for :meth:`TensorBoardLog.scalars`.

    ``purge_step``: a resumed run passes the step it resumes at, and TensorBoard then hides
    the events of earlier files in ``log_dir`` at that step or later (the interrupted run's
    steps past its last checkpoint), so the charts show one history.

    Raises:
        ConfigError: :data:`MISSING_TENSORBOARD`, when the ``tensorboard`` package is not
            importable (the run asked for event files; it does not train without them).
        ValueError: ``purge_step`` not None or a non-negative int.
    """
    if purge_step is not None and (
        isinstance(purge_step, bool) or not isinstance(purge_step, int) or purge_step < 0
    ):
        raise ValueError(f"purge_step must be None or a non-negative int, got {purge_step!r}")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(
            f"{MISSING_TENSORBOARD} (asked to write event files to {log_dir}; {exc})"
        ) from exc
    path = Path(log_dir)
    return TensorBoardLog(SummaryWriter(log_dir=str(path), purge_step=purge_step), path)
