"""The process group and device of this rank, under torchrun or as a single process.

One code path for every backend: the device type picks the backend (``cpu``: gloo, ``cuda``:
NCCL, ``npu``: HCCL with ``torch_npu`` imported only then); the device module is found through
``torch.get_device_module``, never named.

Collective timeout: ``init_runtime(timeout_s=...)``, else ``HP_TRAIN_COLLECTIVE_TIMEOUT``
(seconds), else torch's default for the backend (30 minutes on gloo, 10 on NCCL). Every group
of the job gets it (the default group here, the mesh axes' groups in hp_dtensor), and in a
torchrun job hp_dtensor's watchdog is on with it: a collective that a rank never joins makes
the waiting ranks raise :class:`hp_dtensor.watchdog.CollectiveTimeoutError` at the timeout,
naming the collective, its group and the ranks that did not arrive, so the job exits non-zero
(torchrun then stops the remaining ranks) instead of hanging.

Teardown: :func:`shutdown` (every rank, after a barrier) and :func:`release_process_groups`
(no barrier: a rank leaving on an error) free the job's process groups before the interpreter
finalizes. A gloo backend runs its collectives on worker threads; a worker that drops the last
reference to a tensor whose Python object is gone must take the GIL to free it, and during
finalization Python ends such a thread in the middle of a C++ destructor, which aborts the
process ("terminate called without an active exception", SIGABRT) after correct work. Freeing
a backend joins its workers, and torch releases the GIL while it does, so they finish first.

Restarts: under ``torchrun --max-restarts`` the ranks of every round create their process
group on a store of the round's own, served by the round's rank 0 (:func:`_round_store`):
torchrun's store outlives the rounds with the last round's ranks' addresses in it.

Fault injection, for tests: ``HP_TRAIN_INJECT_STALL=<rank>:<n>`` makes rank ``<rank>`` stop
for good before its ``n``-th collective issued through hp_dtensor, as a rank that never joins.
"""

from __future__ import annotations

import gc
import math
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Public as torch.distributed.Store and .rendezvous, but torch's stubs only export them here.
from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.rendezvous import rendezvous

from hp_dtensor import watchdog
from hp_dtensor.device import backend_for
from hp_dtensor.device_mesh import forget_groups

__all__ = [
    "STALL_ENV",
    "TIMEOUT_ENV",
    "Runtime",
    "init_runtime",
    "release_process_groups",
    "shutdown",
]


#: The collective timeout in seconds, when ``init_runtime`` is given none.
TIMEOUT_ENV = "HP_TRAIN_COLLECTIVE_TIMEOUT"
#: ``<rank>:<n>``: that rank stops for good before its n-th hp_dtensor collective (tests).
STALL_ENV = "HP_TRAIN_INJECT_STALL"
# How long a rank tries an address of the round store before reading it again.
_STALE_PROBE = timedelta(seconds=1)
# How long the ranks may take to all start (imports, a slow file system) when the collective
# timeout is shorter: torch's default group timeout.
_STARTUP = dist.default_pg_timeout


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


def _timeout(timeout_s: float | None) -> float | None:
    """The collective timeout asked for: the argument, else the environment's, else None."""
    source = "timeout_s"
    value: Any = timeout_s
    if value is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return None
        source = TIMEOUT_ENV
        try:
            value = float(text)
        except ValueError:
            value = text
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{source} must be a number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{source} must be a positive number of seconds, got {value!r}")
    return float(value)


def _stall_hook(rank: int) -> watchdog.EntryHook | None:
    """The entry hook of ``HP_TRAIN_INJECT_STALL`` for this rank, if it names this rank."""
    text = os.environ.get(STALL_ENV, "").strip()
    if not text:
        return None
    try:
        who, at = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{STALL_ENV} must be <rank>:<n>, got {text!r}") from None
    if at < 1:
        raise ValueError(f"{STALL_ENV}: n counts collectives from 1, got {at}")
    if who != rank:
        return None

    def stall(collective: str, group: str, number: int) -> None:
        if number != at:
            return
        print(
            f"hp-train: {STALL_ENV}: rank {rank} stalls before its collective #{number} "
            f"({collective} over group {group})",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)

    return stall


def _restartable() -> bool:
    """Whether torchrun may restart this job's workers while its store lives on (``--max-restarts``
    with the agent's store, which the workers of every round share)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def _round_store(agent: Store, rank: int, world: int, wait: timedelta) -> Store:
    """A store of this round's own, served by its rank 0 (collective over the round's ranks).

    torchrun keeps one store for every round of a restarted job, and the keys the previous
    round's process group wrote there (each rank's address) stay: the new round's ranks would
    connect to the dead processes' ports. So rank 0 serves a new store and publishes its
    address in the agent's store; a rank that reads an address of an earlier round finds
    nobody serving it (every worker of a round is stopped before the next round starts) and
    reads again."""
    key = "hp_train/round_store"
    if rank == 0:
        server = TCPStore(
            _reachable_address(), 0, world, is_master=True, timeout=wait, wait_for_workers=False
        )
        agent.set(key, f"{_reachable_address()}:{server.port}")
        return server
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        host, _, port = agent.get(key).decode().rpartition(":")
        try:
            client = TCPStore(host, int(port), world, is_master=False, timeout=_STALE_PROBE)
        except (RuntimeError, OSError):  # an earlier round's address: nobody serves it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        client.set_timeout(wait)
        return client


def _reachable_address() -> str:
    """This host's address on the interface that reaches torchrun's store (where the other
    ranks reach it from too)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        address: str = probe.getsockname()[0]
    return address


def _rendezvous(timeout: float | None) -> tuple[Store, int, int]:
    """torchrun's ``env://`` rendezvous (with a store of the round's own when torchrun may
    restart the workers: :func:`_round_store`), then every rank waiting for every other on
    its store, both allowed :data:`_STARTUP` or the collective timeout if longer; returns
    (store, rank, world size).

    Creating the default group waits for the peers only as long as its timeout: with a
    collective timeout shorter than the ranks' start-up skew, ranks that started first would
    give up before the last one arrives. After this barrier they all create it together."""
    wait = max(_STARTUP, timedelta(seconds=timeout or 0))
    store, rank, world = next(rendezvous("env://", timeout=wait))
    if _restartable():
        store = _round_store(store, rank, world, wait)
    if store.add("hp_train/started", 1) == world:
        store.set("hp_train/all_started", "1")
    store.wait(["hp_train/all_started"], wait)
    return store, rank, world


def init_runtime(
    device_type: str, *, threads: int | None = None, timeout_s: float | None = None
) -> Runtime:
    """Initialize the default process group (from torchrun's environment, or as a one-rank
    job when there is none) and this rank's device.

    ``threads``: intra-op threads on the CPU (default: the host's cores shared evenly among
    its ranks). ``timeout_s``: the collective timeout (default: ``HP_TRAIN_COLLECTIVE_TIMEOUT``,
    else torch's); see the module docstring. A process group that exists already (a test's)
    is used as it is, with its own timeout.

    Raises:
        ValueError: an unknown device type, a timeout that is not a positive number, a
            malformed ``HP_TRAIN_INJECT_STALL``.
        RuntimeError: ``npu`` without an importable ``torch_npu``.
    """
    # hp-dtensor's one backend table; it also loads torch_npu for "npu" (registering the device
    # and HCCL) and names the device types it takes.
    backend = backend_for(device_type)
    timeout = _timeout(timeout_s)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cpu":
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    else:
        device = torch.device(device_type, local_rank)
        torch.get_device_module(device_type).set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            stall = _stall_hook(int(os.environ["RANK"]))
            device_id = None if device_type == "cpu" else device
            if timeout is None and not _restartable():
                dist.init_process_group(backend, device_id=device_id)
            else:
                store, rank, world = _rendezvous(timeout)
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world,
                    device_id=device_id,
                    timeout=None if timeout is None else timedelta(seconds=timeout),
                )
            # The watchdog quotes the default group's timeout when none was asked for.
            default = watchdog.group_timeout() if timeout is None else None
            watchdog.configure(timeout or (default.total_seconds() if default else None))
            watchdog.set_entry_hook(stall)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown() -> None:
    """Barrier, then :func:`release_process_groups` (teardown without the barrier can abort on
    gloo). A rank that never reaches the barrier makes it raise
    :class:`hp_dtensor.watchdog.CollectiveTimeoutError` at the timeout."""
    if dist.is_initialized():
        with watchdog.watch("barrier (shutdown)"):
            dist.barrier()
        release_process_groups()


def release_process_groups() -> int:
    """Stop hp_dtensor's watchdog thread, destroy every process group of the job and free
    their backends now, while the interpreter runs (module docstring); no collective, so a rank
    leaving on an error may call it alone. Returns how many of the job's groups are still
    referenced elsewhere afterwards (0: every backend and its worker threads are gone); such a
    group is freed when its last holder lets go, at the latest during finalization.
    """
    if not dist.is_initialized():
        return 0
    # The publisher writes to the default group's store: it stops before the store can go.
    watchdog.stop()
    # torch keeps no public list of the job's groups; pg_map holds every one it created.
    groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
    dist.destroy_process_group()
    # hp_dtensor's tables of groups and meshes, and the watchdog's counts, hold them too.
    forget_groups()
    # Groups referenced only from garbage cycles (a model and its sharding state) go now too.
    gc.collect()
    return sum(ref() is not None for ref in groups)
