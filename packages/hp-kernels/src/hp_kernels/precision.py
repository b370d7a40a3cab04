"""Which precision a matmul-bound iteration should run in on this process's hardware.

Some CPUs have no native bf16 matmul (no AVX-512 BF16 and no AMX): there a bf16 ``mm`` runs
tens of times slower than fp32 (measured 49x on an AVX2 EPYC), so Newton-Schulz in bf16, as
``torch.optim.Muon`` runs it, costs far more than in fp32. :func:`bf16_matmul_is_slow` tells,
once per process and device type: accelerators are taken as fast; on the CPU the answer comes
from the CPU's feature flags where the kernel lists them (``/proc/cpuinfo``: ``avx512_bf16`` or
``amx_bf16`` on x86, ``bf16`` on Arm mean native bf16), so that every process of a machine
decides alike. Only where no flags can be read does a one-off calibration time a 128 x 128
matmul in both dtypes on one thread (best of 3) and call bf16 slow when it takes more than
:data:`SLOW_RATIO` times fp32: timings of a machine whose ratio lies near the threshold (AVX-512
without BF16 emulates bf16 at about 2x) could decide differently in two processes, and two
ranks, or a run and its resumption, would then orthonormalize in different dtypes. The
environment variable ``HP_KERNELS_BF16_MATMUL=fast|slow`` states the answer instead.
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
    "native_bf16_from_cpuinfo",
    "newton_schulz_dtype",
    "warn_if_bf16_is_slow",
]

ENV_VARIABLE = "HP_KERNELS_BF16_MATMUL"
SLOW_RATIO = 2.0
"""Where no CPU flags can be read: bf16 counts as slow when its matmul takes more than this
many times fp32's."""
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO = "/proc/cpuinfo"


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
    native = native_bf16_from_cpuinfo(_read_cpuinfo())
    if native is not None:
        return not native
    return _calibrated_bf16_is_slow()


def native_bf16_from_cpuinfo(cpuinfo: str | None) -> bool | None:
    """Whether the CPU described by ``cpuinfo`` (``/proc/cpuinfo``'s text) has native bf16
    matmul instructions; None where the text lists no feature flags (or is None)."""
    if cpuinfo is None:
        return None
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        # x86 lists its features under "flags", Arm under "Features".
        if colon and key.strip() in ("flags", "Features"):
            return not _NATIVE_BF16_FLAGS.isdisjoint(value.split())
    return None


def _read_cpuinfo() -> str | None:
    try:
        with open(_CPUINFO, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _calibrated_bf16_is_slow() -> bool:
    """A timing of both dtypes' matmul, on one thread whatever the process uses."""
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
