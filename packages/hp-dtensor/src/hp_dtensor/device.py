"""Device types and their communication backends, with no hard-coded device module.

``cpu`` uses gloo, ``cuda`` NCCL and ``npu`` HCCL. ``torch_npu`` is imported only when an
``npu`` device is asked for. Streams and events go through ``torch.accelerator``.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["backend_for", "local_device", "prepare_device_type"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def prepare_device_type(device_type: str) -> str:
    """Check ``device_type`` and load what it needs (``torch_npu`` for ``npu``)."""
    if device_type not in _BACKENDS:
        raise ValueError(f"unsupported device type {device_type!r}; use one of {sorted(_BACKENDS)}")
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise RuntimeError(
                "device type 'npu' needs torch_npu (Ascend's CANN runtime); it failed to import: "
                f"{exc}"
            ) from exc
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
