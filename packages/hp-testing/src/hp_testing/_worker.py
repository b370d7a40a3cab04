"""The worker side of :class:`hp_testing.RankPool` (runs in each spawned rank process).

Protocol: every message is a pickled tuple sent with ``Connection.send_bytes``.

parent -> worker:
    ``("run", task_id, payload, sys_path)``  payload = pickled ``(fn, args, kwargs)``
    ``("sync", task_id, barrier_timeout)``  after every rank returned: barrier, then report
    ``("close", barrier_timeout)``  barrier, destroy the process group, exit
worker -> parent:
    ``("ready", pid)`` / ``("init_error", traceback)``
    ``("result", task_id, ok, data, wall_time)``  data = pickled result or a traceback
    ``("synced", task_id, ok, traceback_or_None)``
    ``("closed",)``

torch is imported only inside :func:`worker_main`, after the environment is set up.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import IO, Any, NoReturn


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to join its pool's process group."""

    rank: int
    world_size: int
    backend: str
    pg_timeout: float
    host: str
    port: int
    generation: int
    sys_path: tuple[str, ...]
    stack_file: str | None


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _exit_now(code: int) -> NoReturn:
    """Leave without interpreter teardown (process-group threads can hang it)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _setup_environment(config: WorkerConfig) -> None:
    sys.path[:] = list(config.sys_path)
    os.environ.update(
        {
            "RANK": str(config.rank),
            "WORLD_SIZE": str(config.world_size),
            "LOCAL_RANK": str(config.rank),
            "LOCAL_WORLD_SIZE": str(config.world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": config.host,
            "MASTER_PORT": str(config.port),
        }
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Ctrl-C reaches the whole foreground process group; the parent handles it (and kills us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _register_stack_dump(config: WorkerConfig) -> IO[str] | None:
    """On SIGUSR1, write every thread's Python stack to ``config.stack_file``."""
    if config.stack_file is None or not hasattr(signal, "SIGUSR1"):
        return None
    handle = open(config.stack_file, "w", encoding="utf-8")  # noqa: SIM115 (lives with us)
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    return handle


def _init_process_group(config: WorkerConfig) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore  # = torch.distributed.*

    torch.set_num_threads(1)
    timeout = timedelta(seconds=config.pg_timeout)
    store = TCPStore(config.host, config.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=config.backend,
        store=PrefixStore(f"hp_testing/generation{config.generation}", store),
        rank=config.rank,
        world_size=config.world_size,
        timeout=timeout,
    )


def _run_task(payload: bytes) -> tuple[bool, bytes | str]:
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
    except BaseException:  # SystemExit too: the task failed
        return False, traceback.format_exc()
    try:
        return True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        return False, (
            f"the value fn returned ({type(value).__qualname__}) cannot be pickled; return "
            "picklable values (tensors as CPU tensors):\n" + traceback.format_exc()
        )


def _barrier(timeout: float) -> str | None:
    """Barrier over the default group; the traceback if it fails or times out."""
    import torch.distributed as dist

    try:
        dist.barrier(timeout=timedelta(seconds=timeout))
    except BaseException:
        return traceback.format_exc()
    return None


def _close(conn: Connection, barrier_timeout: float) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        _barrier(barrier_timeout)
        with contextlib.suppress(Exception):  # exiting anyway
            dist.destroy_process_group()
    with contextlib.suppress(OSError):
        _send(conn, ("closed",))


def worker_main(config: WorkerConfig, conn: Connection) -> None:
    """Entry point of one rank process: join the group, then serve tasks until told to stop."""
    stack_handle: IO[str] | None = None
    try:
        _setup_environment(config)
        stack_handle = _register_stack_dump(config)
        _init_process_group(config)
    except BaseException:
        try:
            _send(conn, ("init_error", traceback.format_exc()))
        finally:
            _exit_now(1)
    try:
        _send(conn, ("ready", os.getpid()))
        while True:
            message = pickle.loads(conn.recv_bytes())
            kind = message[0]
            if kind == "run":
                _, task_id, payload, sys_path = message
                sys.path[:] = list(sys_path)
                ok, data = _run_task(payload)
                _send(conn, ("result", task_id, ok, data, time.time()))
            elif kind == "sync":
                _, task_id, barrier_timeout = message
                error = _barrier(barrier_timeout)
                _send(conn, ("synced", task_id, error is None, error))
            elif kind == "close":
                _close(conn, message[1])
                break
            else:
                raise RuntimeError(f"hp_testing worker: unknown message {kind!r}")
    except (EOFError, OSError):
        pass  # the parent went away (or closed its end): nothing left to do
    finally:
        if stack_handle is not None:
            faulthandler.unregister(signal.SIGUSR1)
            stack_handle.close()
        _exit_now(0)
