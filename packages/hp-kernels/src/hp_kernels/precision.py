"""Which precision a matmul-bound iteration should run in on this process's hardware.

Some CPUs have no native bf16 matmul (no AVX-512 BF16 and no AMX): there a bf16 ``mm`` runs
tens of times slower than fp32 (measured 49x on an AVX2 EPYC), so Newton-Schulz in bf16, as
``torch.optim.Muon`` runs it, costs far more than in fp32. :func:`bf16_matmul_is_slow` tells,
once per process and device type: accelerators are taken as fast; on the CPU a one-off
calibration times a 128 x 128 matmul in both dtypes on one thread (best of 3) and calls bf16
slow when it takes more than :data:`SLOW_RATIO` times fp32. The environment variable
``HP_KERNELS_BF16_MATMUL=fast|slow`` states the answer instead (no calibration).
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import torch

__all__ = [
    "ENV_VARIABLE",
    "SLOW_RATIO",
    "bf16_matmul_is_slow",
    "newton_schulz_dtype",
    "warn_if_bf16_is_slow",
]

ENV_VARIABLE = "HP_KERNELS_BF16_MATMUL"
SLOW_RATIO = 2.0
"""bf16 counts as slow when its matmul takes more than this many times fp32's."""


@functools.cache
def bf16_matmul_is_slow(device_type: str = "cpu") -> bool:
    """Whether bf16 matmuls are slow on ``device_type`` in this process (cached).

    Raises:
        ValueError: ``HP_KERNELS_BF16_MATMUL`` holds something other than ``fast``/``slow``.
    """
    forced = os.environ.get(ENV_VARIABLE, "")
    if forced:
        if forced not in ("fast", "slow"):
            raise ValueError(f"{ENV_VARIABLE}={forced!r}: use 'fast' or 'slow' (or unset it)")
        return forced == "slow"
    if device_type != "cpu":
        return False
    # On one thread: the verdict is about a core's matmul units, and a small fp32 matmul
    # split over threads of a busy machine can take longer than bf16's (measured 9x longer on
    # a loaded 2-core AVX2 VM, which called bf16 fast there).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best_time(torch.bfloat16) > SLOW_RATIO * _best_time(torch.float32)
    finally:
        torch.set_num_threads(threads)


def _best_time(dtype: torch.dtype) -> float:
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    a @ a  # warm-up: kernel selection, first-touch allocation
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(4):
            a @ a
        best = min(best, time.perf_counter() - start)
    return best


def newton_schulz_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype Newton-Schulz runs in by default on ``device``: fp32 where bf16 matmuls are
    slow (:func:`bf16_matmul_is_slow`), bf16 (``torch.optim.Muon``'s) elsewhere."""
    device_type = torch.device(device).type
    return torch.float32 if bf16_matmul_is_slow(device_type) else torch.bfloat16


@functools.cache
def warn_if_bf16_is_slow(device_type: str, what: str) -> bool:
    """Warn once per (device type, ``what``) that ``what`` asks for bf16 where bf16 matmuls are
    slow; returns whether it warned."""
    if not bf16_matmul_is_slow(device_type):
        return False
    warnings.warn(
        f"{what} asks for bf16 compute, but this {device_type.upper()} has no fast bf16 matmul "
        f"(no AVX-512 BF16 / AMX; {torch.backends.cpu.get_cpu_capability()}): bf16 matmuls "
        "run several times slower than fp32 here; prefer fp32 on this machine",
        stacklevel=3,
    )
    return True
