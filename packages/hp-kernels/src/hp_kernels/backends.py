"""Which implementation runs an op: chosen per call from the input's device type.

Each op has a pure-PyTorch reference (:mod:`hp_kernels.reference`) that works on every device
and a native kernel per device type where one exists:

========  ==================================================================================
``cpu``   the C++ extension built with the package (pack/unpack, Newton-Schulz)
``cuda``  Triton kernels (pack/unpack) when ``triton`` imports; symmetric-memory fused ops
          (all-gather + matmul, matmul + reduce-scatter) when enabled for the group
``npu``   ``torch_npu`` ops when ``torch_npu`` imports (foreach copies, mc2 fused ops)
========  ==================================================================================

A native kernel that is missing (not built, library not installed) is not an error: the op runs
the reference and logs one warning per (op, device type) and process, not one per call. Setting
``HP_KERNELS_FORCE_REFERENCE=1`` makes every op run its reference (read at each call, so it can
be toggled in a running process).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hp_kernels._extension import load_cpu_extension

__all__ = [
    "FORCE_REFERENCE_ENV",
    "Native",
    "available_backends",
    "force_reference",
    "pick",
    "reset_warnings",
]

FORCE_REFERENCE_ENV = "HP_KERNELS_FORCE_REFERENCE"
"""Environment variable: ``1`` (or ``true``/``yes``/``on``) runs every op's reference."""

logger = logging.getLogger("hp_kernels")

_warned: set[tuple[str, str]] = set()


def force_reference() -> bool:
    """Whether :data:`FORCE_REFERENCE_ENV` asks for the reference implementations."""
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def cpu_extension_missing() -> str | None:
    """``None`` when the C++ CPU extension is loaded, else why not."""
    return load_cpu_extension()


@functools.cache
def triton_missing() -> str | None:
    """``None`` when Triton can be imported (CUDA kernels), else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


@functools.cache
def torch_npu_missing() -> str | None:
    """``None`` when ``torch_npu`` is installed, else why not. Never imports it."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    return None


@dataclass(frozen=True)
class Native:
    """A native kernel of one op for one device type.

    Attributes:
        backend: its name in messages and in :func:`available_backends`.
        missing: returns ``None`` when the kernel can run, else why it cannot.
        kernel: the implementation, same signature as the op's reference.
    """

    backend: str
    missing: Callable[[], str | None]
    kernel: Callable[..., Any]


def warn_fallback(op: str, device_type: str, message: str) -> None:
    """Log that ``op`` on ``device_type`` runs its reference because of ``message``, once per
    (op, device type) and process (every fallback of the package reports through here)."""
    if (op, device_type) in _warned:
        return
    _warned.add((op, device_type))
    logger.warning(
        "hp_kernels.%s on %s: %s; running the PyTorch reference", op, device_type, message
    )


def reset_warnings() -> None:
    """Forget which fallbacks were already reported (for tests)."""
    _warned.clear()


def pick(op: str, device_type: str, natives: Mapping[str, Native]) -> Callable[..., Any] | None:
    """The native kernel of ``op`` for ``device_type``, or ``None`` for the reference.

    Logs one warning per (op, device type) the first time a device type has no runnable native
    kernel; forcing the reference (:data:`FORCE_REFERENCE_ENV`) logs nothing.
    """
    if force_reference():
        return None
    native = natives.get(device_type)
    if native is None:
        warn_fallback(op, device_type, f"no native kernel for device type {device_type!r}")
        return None
    why = native.missing()
    if why is not None:
        warn_fallback(op, device_type, f"{native.backend} unavailable ({why})")
        return None
    return native.kernel


def available_backends() -> dict[str, str]:
    """What runs on each device type: a backend name, or ``reference (<why>)``.

    Probes only; imports neither ``triton`` nor ``torch_npu``. Symmetric-memory fused ops on
    CUDA depend on the process group at call time and are not listed.
    """
    probes: dict[str, tuple[str, Callable[[], str | None]]] = {
        "cpu": ("cpp-extension", cpu_extension_missing),
        "cuda": ("triton", triton_missing),
        "npu": ("torch_npu", torch_npu_missing),
    }
    out: dict[str, str] = {}
    for device_type, (backend, missing) in probes.items():
        if force_reference():
            out[device_type] = f"reference ({FORCE_REFERENCE_ENV} is set)"
            continue
        why = missing()
        out[device_type] = backend if why is None else f"reference ({why})"
    return out
