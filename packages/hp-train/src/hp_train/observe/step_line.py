"""The one-line report of a training step, as the log file (and a console that is no
terminal) shows it every ``log_every`` steps::

    step 20/40 | loss 3.2109 | lr muon 1.2e-3 adamw 3.0e-4 | grad norm 0.812 |
    tokens/s 1.23e4 | step 85.2 ms | MFU 12.3% | peak RSS 350 MiB

(one line; wrapped here). :func:`step_line` is pure: the trainer gathers the figures, this
module only formats them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["MFU_UNKNOWN", "StepFigures", "format_number", "step_line"]

#: What the line says for MFU when no peak FLOP/s is known.
MFU_UNKNOWN = "MFU n/a (pass --peak-tflops)"


def format_number(value: float) -> str:
    """Three significant digits (``0.812``, ``85.2``), whole numbers from 100 on (``350``,
    ``4138``), ``1.2e-3`` style below 0.01 and from 10000 on (``1.23e4``); ``nan``, ``inf``
    and ``-inf`` as such."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-2:
        mantissa, _, exponent = f"{value:.2e}".partition("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


@dataclass(frozen=True)
class StepFigures:
    """The figures of one step.

    Attributes:
        step: the step, 1-based (the first step is 1).
        total: the run's last step (``steps``).
        loss: the global loss.
        lr: learning rate per optimizer group, by group name (e.g. ``muon``, ``adamw``).
        grad_norm: the global gradient norm, or None where not computed.
        tokens_per_s: tokens of the global batch per second of the step.
        step_time_s: the step's wall time in seconds.
        mfu: model FLOPs utilization as a fraction, or None without a known peak.
        memory: ``(label, bytes)`` of this rank's memory figure, e.g. ``("peak RSS", n)``,
            or None where the device keeps none.
        extra: more ``name -> value`` pairs, printed last in order (e.g. ``aux loss``).
    """

    step: int
    total: int
    loss: float
    lr: Mapping[str, float]
    grad_norm: float | None
    tokens_per_s: float
    step_time_s: float
    mfu: float | None
    memory: tuple[str, int] | None
    extra: Mapping[str, float] = field(default_factory=dict)


def _mib(count: int) -> str:
    mib = count / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"


def step_line(figures: StepFigures) -> str:
    """The step's line: ``step S/T | loss L | lr <group> <lr> ... | grad norm G |
    tokens/s R | step M ms | MFU U% | <memory label> N MiB`` and any extras, ``|``-separated
    (module docstring). The loss has 4 decimals, other numbers :func:`format_number`'s
    three significant digits; a missing grad norm is left out, a missing MFU is
    :data:`MFU_UNKNOWN`, a missing memory figure is ``memory n/a``."""
    f = figures
    parts = [f"step {f.step}/{f.total}", f"loss {f.loss:.4f}"]
    if f.lr:
        parts.append("lr " + " ".join(f"{g} {format_number(v)}" for g, v in f.lr.items()))
    if f.grad_norm is not None:
        parts.append(f"grad norm {format_number(f.grad_norm)}")
    parts.append(f"tokens/s {format_number(f.tokens_per_s)}")
    parts.append(f"step {format_number(f.step_time_s * 1e3)} ms")
    parts.append(MFU_UNKNOWN if f.mfu is None else f"MFU {format_number(f.mfu * 100)}%")
    parts.append("memory n/a" if f.memory is None else f"{f.memory[0]} {_mib(f.memory[1])}")
    parts += [f"{name} {format_number(value)}" for name, value in f.extra.items()]
    return " | ".join(parts)
