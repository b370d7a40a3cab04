"""The peak FLOP/s of one rank, for MFU: stated by the user, or estimated from the machine.

:func:`peak_flops` returns a :class:`Peak` (FLOP/s, or None where nothing is known, and how
the figure was made, for the run's log header):

* ``--peak-tflops`` given: that, per rank;
* CPU: ``threads x clock x FLOPs per cycle`` (:func:`cpu_peak`): the rank's compute threads
  (``torch.get_num_threads()``), the cores' highest clock (cpufreq's ``cpuinfo_max_freq``,
  else ``/proc/cpuinfo``'s ``cpu MHz``), and the fp32 FLOPs one core retires per cycle for
  the widest vector extension its flags list (:data:`CPU_FLOPS_PER_CYCLE`: lanes x 2 for a
  fused multiply-add x 2 FMA units). A bf16 run is priced at the fp32 figure (CPU kernels
  compute bf16 matmuls in fp32 lanes unless the core has AMX, which this estimate ignores);
* CUDA: a small table of dense tensor-core peaks by device name (:data:`CUDA_PEAK_TFLOPS`);
  a device not in it gives None (the step line then says ``MFU n/a (pass --peak-tflops)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

__all__ = [
    "CPU_FLOPS_PER_CYCLE",
    "CUDA_PEAK_TFLOPS",
    "Peak",
    "cpu_flags",
    "cpu_peak",
    "cuda_peak",
    "flops_per_cycle",
    "max_clock_hz",
    "peak_flops",
]

#: fp32 FLOPs per cycle of one core by the widest vector extension of its flags, best first:
#: lanes x 2 (a fused multiply-add) x 2 (FMA units, as in most server cores since Haswell).
CPU_FLOPS_PER_CYCLE: tuple[tuple[str, int], ...] = (
    ("avx512f", 16 * 2 * 2),
    ("fma", 8 * 2 * 2),  # AVX2 with FMA3
    ("avx", 8 * 2),  # one add and one multiply port, no FMA
    ("sse2", 4 * 2),
    ("asimd", 4 * 2 * 2),  # Arm NEON (the flag of aarch64's /proc/cpuinfo)
)

#: Dense (no sparsity) peak TFLOP/s by a substring of ``torch.cuda.get_device_name``: bf16 on
#: the tensor cores, fp32 on the CUDA cores (no TF32: an fp32 run that enables TF32 matmuls
#: should state its peak with ``--peak-tflops``). The first key found in the name wins.
CUDA_PEAK_TFLOPS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "H200": {"bf16": 989.0, "fp32": 67.0},
        "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
        "H100": {"bf16": 989.0, "fp32": 67.0},
        "A100": {"bf16": 312.0, "fp32": 19.5},
        "L40S": {"bf16": 362.0, "fp32": 91.6},
        "A10G": {"bf16": 70.0, "fp32": 31.2},
    }
)


@dataclass(frozen=True)
class Peak:
    """A rank's peak FLOP/s and how it was made.

    Attributes:
        flops: FLOP/s per rank, or None where unknown.
        how: one line for the log header, e.g. ``"given: --peak-tflops 12"`` or
            ``"estimated: 2 threads x 3.10 GHz x 64 fp32 FLOP/cycle (avx512f)"``.
    """

    flops: float | None
    how: str


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo`` text (``flags`` on x86,
    ``Features`` on Arm); empty when there is no such line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def flops_per_cycle(flags: frozenset[str]) -> tuple[int, str] | None:
    """fp32 FLOPs per cycle of one core and the extension it comes from
    (:data:`CPU_FLOPS_PER_CYCLE`), or None when no listed extension is in ``flags``."""
    for flag, flops in CPU_FLOPS_PER_CYCLE:
        if flag in flags:
            return flops, flag
    return None


def max_clock_hz(cpuinfo: str, cpufreq_max_khz: str | None) -> float | None:
    """The cores' highest clock in Hz: cpufreq's ``cpuinfo_max_freq`` (kHz) when given, else
    the largest ``cpu MHz`` of ``/proc/cpuinfo`` (the current clock: a lower bound of the
    peak); None when neither gives a positive number."""
    if cpufreq_max_khz is not None:
        try:
            khz = float(cpufreq_max_khz.strip())
        except ValueError:
            khz = 0.0
        if khz > 0:
            return khz * 1e3
    clocks = []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz":
            try:
                clocks.append(float(value))
            except ValueError:
                continue
    best = max(clocks, default=0.0)
    return best * 1e6 if best > 0 else None


def cpu_peak(cpuinfo: str, cpufreq_max_khz: str | None, threads: int) -> Peak:
    """``threads x clock x FLOPs per cycle`` from ``/proc/cpuinfo`` text (and cpufreq's
    maximum, when readable), or a None peak saying what was missing."""
    per_cycle = flops_per_cycle(cpu_flags(cpuinfo))
    clock = max_clock_hz(cpuinfo, cpufreq_max_khz)
    if per_cycle is None or clock is None:
        missing = "no known vector extension in its flags" if per_cycle is None else "no clock"
        return Peak(None, f"unknown: /proc/cpuinfo has {missing}")
    flops, flag = per_cycle
    return Peak(
        threads * clock * flops,
        f"estimated: {threads} thread(s) x {clock / 1e9:.2f} GHz x {flops} fp32 FLOP/cycle "
        f"({flag}, 2 FMA units assumed)",
    )


def cuda_peak(device_name: str, dtype: str) -> Peak:
    """The table's peak of ``device_name`` for ``dtype`` (``"bf16"`` or ``"fp32"``), or a
    None peak naming the device."""
    for key, peaks in CUDA_PEAK_TFLOPS.items():
        if key in device_name:
            return Peak(
                peaks[dtype] * 1e12,
                f"table: {device_name} {dtype} dense peak {peaks[dtype]:g} TFLOP/s",
            )
    return Peak(None, f"unknown: {device_name} is not in hp-train's table")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def peak_flops(device: torch.device, dtype: str, given_tflops: float | None) -> Peak:
    """The peak FLOP/s of one rank on ``device`` computing in ``dtype`` (module docstring).

    Raises:
        ValueError: ``given_tflops`` not positive.
    """
    if given_tflops is not None:
        if not given_tflops > 0:
            raise ValueError(f"--peak-tflops must be positive, got {given_tflops}")
        return Peak(given_tflops * 1e12, f"given: --peak-tflops {given_tflops:g}")
    if device.type == "cpu":
        cpuinfo = _read("/proc/cpuinfo")
        if cpuinfo is None:
            return Peak(None, "unknown: no /proc/cpuinfo")
        cpufreq = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
        return cpu_peak(cpuinfo, cpufreq, torch.get_num_threads())
    if device.type == "cuda" and torch.cuda.is_available():
        return cuda_peak(torch.cuda.get_device_name(device), dtype)
    return Peak(None, f"unknown: no peak known for {device.type} devices")
