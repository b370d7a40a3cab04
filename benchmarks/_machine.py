"""What machine a benchmark ran on, printed by every script: figures from different CPUs are not
comparable (a CPU without AVX-512 BF16 or AMX runs bf16 matmuls tens of times slower than fp32).

``machine_line()`` is one line: host, architecture, cores, CPU model, ATen's CPU capability
(``torch.backends.cpu.get_cpu_capability()``), torch version and, when hp-kernels is installed,
whether its one-off calibration found bf16 matmuls slow here. ``machine_info()`` is the same as a
dict for the scripts' JSON lines.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_model", "machine_info", "machine_line"]


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (or what ``platform`` knows)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _bf16_matmul() -> str:
    try:
        from hp_kernels.precision import bf16_matmul_is_slow
    except ImportError:
        return "unknown (hp-kernels not installed)"
    return "slow" if bf16_matmul_is_slow("cpu") else "fast"


def machine_info() -> dict[str, Any]:
    """The machine as a JSON-ready dict."""
    return {
        "host": platform.node(),
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "bf16_matmul": _bf16_matmul(),
    }


def machine_line() -> str:
    """The machine in one line, for the top of a benchmark's output."""
    m = machine_info()
    return (
        f"machine: {m['host']} {m['arch']} {m['cpus']} cpus, {m['cpu']} "
        f"(capability {m['cpu_capability']}, bf16 matmul {m['bf16_matmul']}), torch {m['torch']}"
    )
