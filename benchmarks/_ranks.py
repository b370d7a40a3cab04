"""Spawning local gloo ranks for the benchmarks (one thread each), shared by every script.

``run_local_ranks(world, fn, *args)`` starts ``world`` processes, initializes gloo in each,
runs ``fn(*args)`` on every rank and returns rank 0's result. ``fn`` must be a module-level
function (it is pickled by name into the spawned processes).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_local_ranks"]


def _worker(
    rank: int, world: int, port: int, queue: Any, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(*args)
    if rank == 0:
        queue.put(result)
    # A barrier before teardown: destroying the group while a peer still talks can abort.
    dist.barrier()
    dist.destroy_process_group()


def run_local_ranks(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on ``world`` local gloo ranks; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    spawn: Any = mp.start_processes  # type: ignore[attr-defined]
    spawn(_worker, args=(world, port, queue, fn, args), nprocs=world, start_method="spawn")
    return queue.get()
