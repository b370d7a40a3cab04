"""The vocabulary of a training recipe that plans and prices read: one source for the trainer
and the planner.

A trainer states its options in these words (hp-train's configuration takes its choices from
here); :mod:`hp_planner.price` prices them. Every name is a plain string so that a plan and a
configuration file carry the same text.
"""

from __future__ import annotations

import math

from hp_planner.inputs import (
    CP_VARIANTS,
    DEFAULT_VIRTUAL_STAGES,
    SCHEDULES,
    PlanInputError,
    check_virtual_stages,
)

__all__ = [
    "AC_MODES",
    "CP_VARIANTS",
    "DEFAULT_VIRTUAL_STAGES",
    "FP8_RECIPES",
    "OFFLOAD_TARGETS",
    "SCHEDULES",
    "SWAP_MIN_BYTES",
    "ac_budget_bytes",
    "check_virtual_stages",
]

#: Activation checkpointing per block (``budget:<MiB>`` is the third, parametrized form).
AC_MODES = ("none", "full", "selective")
#: What ``offload`` moves to host memory.
OFFLOAD_TARGETS = ("none", "optimizer", "params", "both")
#: FP8 linear recipes (``hp_kernels.float8``).
FP8_RECIPES = ("none", "tensorwise", "blockwise")
#: Saved activations smaller than this stay on the device when activations are swapped to the
#: host: the per-token statistics are not worth a copy.
SWAP_MIN_BYTES = 1024


def ac_budget_bytes(ac: str) -> int | None:
    """The per-block byte budget of ``ac="budget:<MiB>"``, None for the modes of
    :data:`AC_MODES`.

    Postconditions: a budget is a whole number of bytes > 0, ``int(MiB * 2**20)``.

    Raises:
        PlanInputError: ``ac`` is none of the modes, or its budget is not a finite number > 0.
    """
    if ac in AC_MODES:
        return None
    prefix, _, amount = ac.partition(":")
    try:
        mib = float(amount) if prefix == "budget" else math.nan
    except ValueError:
        mib = math.nan
    if not (math.isfinite(mib) and mib > 0):
        raise PlanInputError(
            f"ac must be one of {', '.join(AC_MODES)} or budget:<MiB> (e.g. budget:64), got {ac!r}"
        )
    return int(mib * 2**20)
