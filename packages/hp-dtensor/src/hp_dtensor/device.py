"""Device types and their communication backends, with no hard-coded device module.

``cpu`` uses gloo, ``cuda`` NCCL and ``npu`` HCCL. ``torch_npu`` is imported only when an
``npu`` device is asked for. Streams and events go through ``torch.accelerator``.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["DeviceUnavailableError", "backend_for", "local_device", "prepare_device_type"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class DeviceUnavailableError(RuntimeError):
    """A device type this machine cannot run: its runtime does not import, or it reports no
    device (the message names which, and what to use instead)."""


def prepare_device_type(device_type: str) -> str:
    """Check ``device_type`` and load what it needs (``torch_npu`` for ``npu``).

    Raises:
        ValueError: a device type with no backend here.
        DeviceUnavailableError: ``npu`` without an importable ``torch_npu``, or an accelerator
            type whose device module reports no device (``torch.cuda.is_available()`` is
            False on a machine without CUDA).
    """
    if device_type not in _BACKENDS:
        raise ValueError(f"unsupported device type {device_type!r}; use one of {sorted(_BACKENDS)}")
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise DeviceUnavailableError(
                "device type 'npu' needs torch_npu (Ascend's CANN runtime); it failed to import: "
                f"{exc}"
            ) from exc
    if device_type != "cpu" and not torch.get_device_module(device_type).is_available():
        raise DeviceUnavailableError(
            f"device type {device_type!r} is not available on this machine "
            f"(torch.{device_type}.is_available() is False: no device or no driver); use "
            "'cpu', or run where the device is"
        )
    return device_type


def backend_for(device_type: str) -> str:
    """The ``torch.distributed`` backend used for ``device_type``."""
    return _BACKENDS[prepare_device_type(device_type)]


def local_device(device_type: str) -> torch.device:
    """The device this process computes on for ``device_type``.

    For accelerators this is ``torch.accelerator``'s current device index, so the caller's
    ``torch.accelerator.set_device_index(local_rank)`` (done by ``init_device_mesh``) decides.
    """
    prepare_device_type(device_type)
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())
