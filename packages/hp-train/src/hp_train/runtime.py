"""The process group and device of this rank, under torchrun or as a single process.

One code path for every backend: the device type picks the backend (``cpu``: gloo, ``cuda``:
NCCL, ``npu``: HCCL with ``torch_npu`` imported only then); the device module is found through
``torch.get_device_module``, never named.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Runtime", "init_runtime", "shutdown"]

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Runtime:
    """Where this process runs.

    Attributes:
        rank: global rank.
        world_size: ranks in the job.
        local_rank: rank on this host (picks the accelerator).
        device: this rank's device.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_runtime(device_type: str, *, threads: int | None = None) -> Runtime:
    """Initialize the default process group (from torchrun's environment, or as a one-rank
    job when there is none) and this rank's device.

    ``threads``: intra-op threads on the CPU (default: the host's cores shared evenly among
    its ranks).

    Raises:
        ValueError: an unknown device type.
    """
    if device_type not in _BACKENDS:
        raise ValueError(f"device must be one of {sorted(_BACKENDS)}, got {device_type!r}")
    if device_type == "npu":
        importlib.import_module("torch_npu")  # registers the npu device and HCCL
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cpu":
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    else:
        device = torch.device(device_type, local_rank)
        torch.get_device_module(device_type).set_device(device)
    if not dist.is_initialized():
        backend = _BACKENDS[device_type]
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=None if device_type == "cpu" else device)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown() -> None:
    """Barrier, then destroy the default process group (teardown without the barrier can
    abort on gloo)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
