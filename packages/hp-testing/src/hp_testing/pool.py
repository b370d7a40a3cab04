"""A persistent pool of rank processes for multi-process tests: spawn once, run many tasks.

See :class:`RankPool` and :func:`run_on_ranks`.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, TypeVar

# TCPStore is public as torch.distributed.TCPStore, but torch's stubs only export it from here.
from torch._C._distributed_c10d import TCPStore

from hp_testing._worker import WorkerConfig, worker_main
from hp_testing.errors import RankFailure, RankTimeout

__all__ = ["RankPool", "close_all_pools", "get_pool", "run_on_ranks"]

T = TypeVar("T")

_HOST = "127.0.0.1"
#: Longest after-task barrier (all ranks have returned by then: only a collective left
#: pending, or a broken group, keeps it waiting).
_BARRIER_TIMEOUT = 10.0
#: Extra time the parent gives a worker to report its own barrier timeout.
_BARRIER_SLACK = 2.0
#: How long close() waits for the workers to leave cleanly before killing them.
_CLOSE_TIMEOUT = 30.0
#: How long a killed worker may take to disappear.
_KILL_JOIN_TIMEOUT = 10.0
#: How long to wait for a stack dump after SIGUSR1.
_STACK_DUMP_WAIT = 1.0

_CONTEXT = multiprocessing.get_context("spawn")


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _describe(fn: object) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection
    stack_file: str | None
    ready: bool = False


@dataclass(order=True)
class _Failure:
    sort_key: tuple[int, float]
    rank: int = field(compare=False)
    text: str = field(compare=False)


@dataclass
class _Round:
    """What the parent learned from the workers during one task."""

    failures: list[_Failure] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    returned: set[int] = field(default_factory=set)
    synced: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    barrier_failed: set[int] = field(default_factory=set)
    first_failure_at: float | None = None

    def fail(self, rank: int, text: str, *, dead: bool = False, stamp: float | None = None) -> None:
        if dead:
            self.dead.add(rank)
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()
        # Dead workers first (their peers' errors are usually a consequence), then by time.
        key = (0 if dead else 1, time.time() if stamp is None else stamp)
        self.failures.append(_Failure(key, rank, text))

    def record(self, task_id: int, rank: int, message: tuple[Any, ...]) -> None:
        """Take one message of rank ``rank`` about task ``task_id`` (others are ignored): its
        result (or failure), or the outcome of its after-task barrier."""
        kind = message[0]
        if kind == "result" and message[1] == task_id:
            _, _, ok, data, stamp = message
            self.returned.add(rank)
            if not ok:
                self.fail(rank, data, stamp=stamp)
                return
            try:
                self.results[rank] = pickle.loads(data)
            except Exception as exc:
                self.fail(
                    rank,
                    f"the result of rank {rank} cannot be unpickled in the parent: "
                    f"{type(exc).__name__}: {exc}",
                    stamp=stamp,
                )
        elif kind == "synced" and message[1] == task_id:
            self.synced.add(rank)
            if not message[2]:
                self.barrier_failed.add(rank)
                self.fail(
                    rank,
                    "the after-task barrier failed (a collective left pending by the task, "
                    f"or a broken process group):\n{message[3]}",
                )

    def ordered_failures(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for failure in sorted(self.failures):
            if failure.rank in out:
                out[failure.rank] += "\n" + failure.text
            else:
                out[failure.rank] = failure.text
        return out


class RankPool:
    """``world_size`` persistent worker processes, one per rank, in one process group.

    Workers are started with the ``spawn`` method. Each one inherits the parent's
    ``sys.path`` (refreshed for every task, so test modules are importable), sets
    ``torch.set_num_threads(1)``, sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and joins a ``torch.distributed``
    process group of the given ``backend`` through a TCP store that the parent hosts on a free
    port, with ``timeout`` seconds as the group's timeout. Spawning costs a few seconds; it is
    paid when the pool is created (the constructor does not wait: the first :meth:`run` does)
    and again only after a task broke the pool.

    Tasks run on every rank with :meth:`run`. After every rank has returned, each worker calls
    ``torch.distributed.barrier`` (with a timeout), so a task that left a collective pending
    is detected and reported as a failure instead of corrupting the next task.

    Per-task state is NOT reset: the same processes run task after task, so global state a
    task changes (RNG state, default dtype, environment, modules it imported) stays for the
    next one. In particular ``torch.manual_seed`` is not called for you: seed explicitly in
    every task that uses random numbers.

    A pool is not thread-safe for concurrent :meth:`run` calls (they are serialized). It is
    closed by :meth:`close`, by ``with RankPool(...) as pool:``, or at interpreter exit.

    Args:
        world_size: number of ranks (>= 1).
        backend: ``torch.distributed`` backend; ``"gloo"`` (CPU) for tests.
        timeout: process-group timeout, the default timeout of :meth:`run`, and how long the
            workers may take to start.
        failure_grace: after the first rank fails, how long to wait for the other ranks to
            answer before killing them (they may be blocked in a collective with it).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 120.0,
        failure_grace: float = 1.0,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = _positive("timeout", timeout)
        self.failure_grace = _positive("failure_grace", failure_grace)
        self._lock = threading.RLock()
        self._closed = False
        self._generation = 0
        self._task_id = 0
        self._workers: list[_Worker] = []
        # The parent hosts the store: its port is bound for the pool's whole life (no race
        # for a "free" port), and every generation of workers uses a fresh key prefix.
        self._store: TCPStore | None = TCPStore(
            _HOST,
            0,
            None,
            True,
            timedelta(seconds=self.timeout),
            wait_for_workers=False,
        )
        self._tmpdir = tempfile.mkdtemp(prefix="hp_testing_pool_")  # stack dumps
        _LIVE_POOLS.add(self)
        self._spawn()

    # ------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, in rank order (they change on restart)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    @property
    def port(self) -> int:
        """The TCP store port the workers rendezvous on (``MASTER_PORT`` in the workers)."""
        if self._store is None:
            raise RuntimeError("the pool is closed")
        return int(self._store.port)

    def run(
        self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[T]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be picklable by reference (a module-level function of an importable
        module, such as a test module), and so must its arguments and its return value.
        Return tensors as CPU tensors (``t.cpu()``); they come back by value. ``timeout`` (a
        keyword of this method, so it cannot be passed on to ``fn``) bounds the whole call,
        and defaults to the pool's ``timeout``.

        Raises:
            TypeError: ``fn`` or its arguments cannot be pickled (nothing was run).
            RankFailure: ``fn`` raised on some rank, its result could not be sent back, a
                worker died, or the after-task barrier failed. The message lists, for each
                failing rank, the rank and its full traceback, the first failure first. If
                any worker could be stuck, the pool is restarted first, so the next call works.
            RankTimeout: the call did not finish in ``timeout`` seconds; the message names the
                ranks that did not answer (with their Python stacks where available). The
                workers are killed and the pool restarted.
        """
        run_timeout = self.timeout if timeout is None else _positive("timeout", timeout)
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot send {_describe(fn)} and its arguments to the rank processes ({exc}); "
                "fn must be a module-level function and its arguments picklable"
            ) from exc
        with self._lock:
            self._check_open()
            self._ensure_ready()
            try:
                return self._run(_describe(fn), payload, run_timeout)
            except (RankFailure, RankTimeout):
                raise
            except BaseException:
                # KeyboardInterrupt, an internal error, ...: the workers' state is unknown.
                self._restart()
                raise

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Shut the workers down: barrier, ``destroy_process_group``, exit; kill stragglers.

        Idempotent. ``timeout`` bounds the whole shutdown.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _LIVE_POOLS.discard(self)
            deadline = time.monotonic() + timeout
            barrier_timeout = max(1.0, min(_BARRIER_TIMEOUT, timeout / 2))
            for worker in self._workers:
                with contextlib.suppress(OSError):
                    worker.conn.send_bytes(pickle.dumps(("close", barrier_timeout)))
            for worker in self._workers:
                worker.process.join(max(0.0, deadline - time.monotonic()))
            self._kill_workers()
            self._store = None
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pids={self.pids}"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # ------------------------------------------------------------------------------------
    # worker lifecycle
    # ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _spawn(self) -> None:
        """Start a new generation of workers (does not wait for them)."""
        self._generation += 1
        sys_path = tuple(sys.path)
        workers: list[_Worker] = []
        try:
            for rank in range(self.world_size):
                stack_file = os.path.join(self._tmpdir, f"stack-g{self._generation}-r{rank}.txt")
                config = WorkerConfig(
                    rank=rank,
                    world_size=self.world_size,
                    backend=self.backend,
                    pg_timeout=self.timeout,
                    host=_HOST,
                    port=self.port,
                    generation=self._generation,
                    sys_path=sys_path,
                    stack_file=stack_file,
                )
                parent_end, child_end = _CONTEXT.Pipe(duplex=True)
                process = _CONTEXT.Process(
                    target=worker_main,
                    args=(config, child_end),
                    name=f"hp_testing-rank{rank}-g{self._generation}",
                    daemon=False,  # rank functions may start processes of their own
                )
                process.start()
                child_end.close()  # so that the parent sees EOF when the worker dies
                workers.append(_Worker(rank, process, parent_end, stack_file))
        finally:
            self._workers = workers

    def _kill_workers(self) -> None:
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join(_KILL_JOIN_TIMEOUT)
            worker.conn.close()
            if worker.process.exitcode is not None:
                worker.process.close()
        self._workers = []

    def _restart(self) -> None:
        self._kill_workers()
        if not self._closed:
            self._spawn()

    def _ensure_ready(self) -> None:
        """Wait (at most ``timeout``) until every worker has joined the process group."""
        if not self._workers:
            self._spawn()
        if all(w.ready for w in self._workers):
            return
        deadline = time.monotonic() + self.timeout
        state = _Round()

        def on_message(worker: _Worker, message: tuple[Any, ...]) -> None:
            if message[0] == "ready":
                worker.ready = True
            elif message[0] == "init_error":
                state.fail(worker.rank, message[1])

        while True:
            waiting = [w for w in self._workers if not w.ready and w.rank not in state.dead]
            if not waiting:
                break
            until = deadline
            if state.first_failure_at is not None:
                until = min(deadline, state.first_failure_at + self.failure_grace)
            if not self._poll(waiting, until, state, on_message, "while starting"):
                break
        if state.failures:
            self._kill_workers()
            failures = state.ordered_failures()
            raise RankFailure(
                f"starting {self.world_size} {self.backend} rank process(es) failed on rank(s) "
                f"{list(failures)}:\n" + _format_failures(failures),
                failures,
            )
        late = [w.rank for w in self._workers if not w.ready]
        if late:
            self._kill_workers()
            raise RankTimeout(
                f"rank process(es) {late} of {self.world_size} did not join the "
                f"{self.backend} process group within {self.timeout:g} s; they were killed",
                late,
                self.timeout,
            )

    # ------------------------------------------------------------------------------------
    # one task
    # ------------------------------------------------------------------------------------

    def _poll(
        self,
        workers: list[_Worker],
        until: float,
        state: _Round,
        on_message: Callable[[_Worker, tuple[Any, ...]], None],
        doing: str,
    ) -> bool:
        """Handle what ``workers`` send until ``until``; False once the time is up."""
        remaining = until - time.monotonic()
        if remaining <= 0:
            return False
        by_conn = {id(w.conn): w for w in workers}
        by_sentinel = {w.process.sentinel: w for w in workers}
        objects: list[Any] = [w.conn for w in workers] + list(by_sentinel)
        for ready in wait(objects, remaining):
            if isinstance(ready, int):
                worker = by_sentinel[ready]
                self._drain(worker, state, on_message, doing)
                if worker.rank not in state.dead:
                    self._mark_dead(worker, state, doing)
            elif id(ready) in by_conn:
                self._drain(by_conn[id(ready)], state, on_message, doing)
        return True

    def _drain(
        self,
        worker: _Worker,
        state: _Round,
        on_message: Callable[[_Worker, tuple[Any, ...]], None],
        doing: str,
    ) -> None:
        if worker.rank in state.dead:
            return
        try:
            while worker.conn.poll():
                on_message(worker, pickle.loads(worker.conn.recv_bytes()))
        except (EOFError, OSError):
            self._mark_dead(worker, state, doing)

    def _mark_dead(self, worker: _Worker, state: _Round, doing: str) -> None:
        worker.process.join(1.0)
        if any(f.rank == worker.rank for f in state.failures):
            state.dead.add(worker.rank)  # it already said why (e.g. init_error, then exit)
            return
        code = worker.process.exitcode
        if code is None:
            how = "closed its connection"
        elif code < 0:
            how = f"was killed by signal {_signal_name(-code)}"
        else:
            how = f"exited with code {code}"
        state.fail(
            worker.rank,
            f"the worker process of rank {worker.rank} (pid {worker.process.pid}) {how} {doing}",
            dead=True,
        )

    def _run(self, name: str, payload: bytes, timeout: float) -> list[Any]:
        """Run one pickled task on every rank, then a barrier; the results in rank order."""
        self._task_id += 1
        task_id = self._task_id
        deadline = time.monotonic() + timeout
        state = _Round()
        doing = f"while running {name}"

        def on_message(worker: _Worker, message: tuple[Any, ...]) -> None:
            state.record(task_id, worker.rank, message)

        self._send_all(pickle.dumps(("run", task_id, payload, list(sys.path))), state, doing)
        self._await_results(name, timeout, deadline, state, on_message, doing)
        self._await_barrier(name, timeout, task_id, deadline, state, on_message, doing)
        return [state.results[rank] for rank in range(self.world_size)]

    def _send_all(self, message: bytes, state: _Round, doing: str) -> None:
        """Send ``message`` to every worker (one that cannot be reached is marked dead)."""
        for worker in self._workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                self._mark_dead(worker, state, doing)

    def _await_results(
        self,
        name: str,
        timeout: float,
        deadline: float,
        state: _Round,
        on_message: Callable[[_Worker, tuple[Any, ...]], None],
        doing: str,
    ) -> None:
        """Phase 1: wait for every rank's result (shortened to the grace period once one
        fails); raise, restarting the workers, if a rank failed and another did not answer."""
        while True:
            waiting = [
                w
                for w in self._workers
                if w.rank not in state.returned and w.rank not in state.dead
            ]
            if not waiting:
                break
            until = deadline
            if state.first_failure_at is not None:
                until = min(deadline, state.first_failure_at + self.failure_grace)
            if not self._poll(waiting, until, state, on_message, doing):
                break
        unanswered = [w.rank for w in self._workers if w.rank not in state.returned | state.dead]
        if state.failures and (unanswered or state.dead):
            self._restart()
            self._raise_failure(name, state, unanswered, restarted=True)
        if unanswered:
            self._raise_timeout(name, timeout, unanswered, state.returned, "running the task")

    def _await_barrier(
        self,
        name: str,
        timeout: float,
        task_id: int,
        deadline: float,
        state: _Round,
        on_message: Callable[[_Worker, tuple[Any, ...]], None],
        doing: str,
    ) -> None:
        """Phase 2: everyone returned; barrier so nothing is left pending for the next task.
        Raise on any failure (restarting the workers unless every one is known in sync)."""
        barrier_timeout = max(1.0, min(_BARRIER_TIMEOUT, deadline - time.monotonic()))
        sync_until = max(deadline, time.monotonic() + barrier_timeout + _BARRIER_SLACK)
        self._send_all(pickle.dumps(("sync", task_id, barrier_timeout)), state, doing)
        while True:
            waiting = [
                w for w in self._workers if w.rank not in state.synced and w.rank not in state.dead
            ]
            if not waiting:
                break
            if not self._poll(waiting, sync_until, state, on_message, "in the after-task barrier"):
                break
        unsynced = [w.rank for w in self._workers if w.rank not in state.synced | state.dead]
        if state.failures:
            # Keep the workers only if every one of them is known to be in sync.
            restart = bool(unsynced or state.dead or state.barrier_failed)
            if restart:
                self._restart()
            self._raise_failure(name, state, unsynced, restarted=restart)
        if unsynced:
            self._raise_timeout(
                name, timeout, unsynced, state.returned, "in the after-task barrier"
            )

    def _raise_failure(
        self, name: str, state: _Round, unanswered: Iterable[int], *, restarted: bool
    ) -> NoReturn:
        failures = state.ordered_failures()
        silent = sorted(set(unanswered) - set(failures))
        lines = [
            f"{name} failed on {len(failures)} of {self.world_size} rank(s): "
            f"{list(failures)} (first failure: rank {next(iter(failures))})"
        ]
        if silent:
            lines.append(
                f"rank(s) {silent} had not answered {self.failure_grace:g} s after the first "
                "failure (probably blocked in a collective with a failed rank) and were killed"
            )
        if restarted:
            lines.append("the rank processes were restarted")
        raise RankFailure("\n".join(lines) + "\n" + _format_failures(failures), failures, silent)

    def _raise_timeout(
        self,
        name: str,
        timeout: float,
        pending: list[int],
        returned: set[int],
        where: str,
    ) -> NoReturn:
        stacks = self._dump_stacks(pending)
        self._restart()
        done = sorted(returned - set(pending))
        lines = [
            f"{name} did not finish within {timeout:g} s: rank(s) {pending} of "
            f"{self.world_size} were still {where}"
            + (f" (rank(s) {done} had returned)" if done else "")
            + "; the rank processes were killed and restarted"
        ]
        for rank, stack in stacks.items():
            lines.append(f"\n----- rank {rank}: Python stacks when it was killed -----")
            lines.append(stack.rstrip())
        raise RankTimeout("\n".join(lines), pending, timeout, stacks)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` for their Python stacks (SIGUSR1 -> faulthandler), best effort."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        asked: dict[int, str] = {}
        for worker in self._workers:
            pid = worker.process.pid
            if worker.rank in ranks and worker.ready and worker.stack_file and pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    continue
                asked[worker.rank] = worker.stack_file
        dumped: dict[int, str] = {}
        deadline = time.monotonic() + _STACK_DUMP_WAIT
        while len(dumped) < len(asked) and time.monotonic() < deadline:
            time.sleep(0.05)
            for rank, path in asked.items():
                if rank not in dumped and _read_text(path).strip():
                    dumped[rank] = path
        if dumped:
            time.sleep(0.05)  # let a dump that is still being written finish
        return {rank: _read_text(path) for rank, path in sorted(dumped.items())}


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _format_failures(failures: dict[int, str]) -> str:
    """One block per failing rank; a rank whose traceback repeats an earlier one is folded."""
    blocks: list[str] = []
    seen: dict[str, list[int]] = {}
    for rank, text in failures.items():
        seen.setdefault(text, []).append(rank)
    for text, ranks in seen.items():
        lines = text.rstrip().splitlines()
        headline = lines[-1] if lines else "(no details)"
        blocks.append(f"\n===== rank {ranks[0]}: {headline} =====\n" + "\n".join(lines))
        if len(ranks) > 1:
            blocks.append(f"===== rank(s) {ranks[1:]}: the same traceback as rank {ranks[0]} =====")
    return "\n".join(blocks)


# ----------------------------------------------------------------------------------------
# Module-level registry: one pool per (world_size, backend) for the whole process.
# ----------------------------------------------------------------------------------------

_REGISTRY: dict[tuple[int, str], RankPool] = {}
_REGISTRY_LOCK = threading.Lock()
_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


def get_pool(world_size: int, backend: str = "gloo") -> RankPool:
    """The process-wide pool for ``(world_size, backend)``, created on first use."""
    key = (world_size, backend)
    with _REGISTRY_LOCK:
        pool = _REGISTRY.get(key)
        if pool is None or pool.closed:
            pool = RankPool(world_size, backend=backend)
            _REGISTRY[key] = pool
        return pool


def run_on_ranks(
    world_size: int,
    fn: Callable[..., T],
    /,
    *args: Any,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[T]:
    """``fn(*args, **kwargs)`` on every rank of the shared gloo pool of ``world_size`` ranks.

    The pool is created on first use and reused for the rest of the process (a pytest
    session); see :meth:`RankPool.run` for the rules on ``fn``, results and errors.
    """
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def close_all_pools() -> None:
    """Close every pool of the registry (and any other pool still open in this process)."""
    with _REGISTRY_LOCK:
        pools = list(_REGISTRY.values())
        _REGISTRY.clear()
    for pool in [*pools, *list(_LIVE_POOLS)]:
        pool.close()


atexit.register(close_all_pools)
