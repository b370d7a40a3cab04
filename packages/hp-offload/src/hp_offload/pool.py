"""TensorPool: tensors stored in host memory or in a peer rank's memory, fetched into a
byte-bounded LRU cache ahead of use.

Usage::

    pool = TensorPool(cache_bytes=64 << 20)
    w = pool.put("w", weight, placement=Peer(1))  # staged; shipped to rank 1 by exchange()
    pool.exchange()                                # every rank of the group, same points
    pool.prefetch(["w"])                           # queues the fetch
    pool.exchange()                                # posts it (rank 1 sends, we receive)
    ... compute ...
    x = w.get()                                    # waits for the receive, bit-equal copy

Placements. ``Host()``: the pool keeps a private contiguous CPU copy; ``prefetch``/``get``
copy it into the cache at once. ``Peer(r)``: the bytes live on rank ``r`` of the group; only
this rank (the client) knows the name, shape and dtype, rank ``r`` (the holder) keeps a flat
``uint8`` buffer under ``(client, key)``.

Peer protocol. Gloo has no one-sided access: a transfer needs a matching send and receive.
Peer operations therefore only queue requests (STORE on ``put``, FETCH on ``prefetch``, FREE on
``delete``/placement change/re-put elsewhere) and move data in :meth:`TensorPool.exchange`, a
collective that every rank of the group calls at the same points of its program:

1. Complete: wait (with the timeout) for this rank's FETCH receives posted by the previous
   exchange, so no transfer of an earlier step is outstanding when this step starts.
2. Announce: all-gather the request counts, then all-gather the requests as ``int64`` rows
   ``(kind, holder, key, nbytes)`` (skipped when every count is 0). Every rank now holds the
   same list.
3. Order and validate: every rank walks the list in the same order (client rank ascending,
   each client's requests in the order it queued them) and checks it against a directory of
   ``(client, key) -> (holder, nbytes)`` that every rank mirrors from the announced rows. An
   invalid request raises the same error on every rank before any transfer is posted.
4. Post: request ``i`` of the step that moves bytes (``nbytes > 0``) gets tag ``i``. STORE:
   the client ``isend``s its staged copy, the holder ``irecv``s into a new buffer. FETCH: the
   holder ``isend``s its buffer, the client ``irecv``s into the cached entry's buffer. FREE:
   the holder drops its buffer. All operations are posted (non-blocking) before any is waited.
5. Wait: each rank waits (with the timeout) for its sends and for the receives of its STORE
   requests as holder; then the holder installs the new buffers and the client drops its
   staged copies. Client FETCH receives stay in flight: ``get`` waits for them (or step 1 of
   the next exchange does).

No deadlock: each transfer's send and receive are posted by the two ranks in the same step,
from the same list, with a tag unique in the step, and nothing is waited before every
operation of the step is posted; step 1 makes tags reusable across steps. A rank that does
not call ``exchange`` makes the others fail in step 2 with a TimeoutError (never a hang).
Gloo closes the connection after a timed-out wait, so a pool (and its process group) that
raised TimeoutError is broken: the pool refuses further calls.

Not thread-safe: one pool is used by one thread. The compute device is the CPU.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hp_offload.remote import (
    ByteLRUCache,
    CacheEntry,
    CacheState,
    Host,
    Peer,
    Placement,
    PoolEvent,
    PoolUsage,
    RemoteTensor,
)

__all__ = ["PoolBrokenError", "TensorPool"]

_STORE, _FETCH, _FREE = 1, 2, 3
_KIND_NAMES = {_STORE: "STORE", _FETCH: "FETCH", _FREE: "FREE"}


class PoolBrokenError(RuntimeError):
    """A wait of the pool timed out earlier; its process group can no longer be trusted."""


@dataclass
class _Record:
    """What the client knows about one of its tensors."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    placement: Placement
    key: int
    shipped: bool  # peer: the holder has the current value (no STORE queued)


@dataclass
class _Request:
    kind: int
    holder: int
    key: int
    nbytes: int
    name: str


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous CPU ``uint8`` tensor with ``tensor``'s bytes."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).clone()


def _typed(buffer: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """View the flat ``uint8`` ``buffer`` as a tensor of ``shape`` and ``dtype``."""
    return buffer.view(dtype).reshape(shape)


class TensorPool:
    """Tensors placed in host or peer memory, fetched into an LRU cache of ``cache_bytes``.

    Args:
        cache_bytes: bound on the bytes of cached working copies (``>= 0``).
        group: process group for peer placements (default: the default group, if one is
            initialized; without one, only ``Host()`` placements work).
        timeout: seconds every wait (collective or transfer) may take before TimeoutError.
        event_log: how many most recent events :attr:`events` keeps.

    Raises:
        ValueError: a bad ``cache_bytes``, ``timeout`` or ``event_log``.
    """

    def __init__(
        self,
        cache_bytes: int,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
        event_log: int = 10_000,
    ) -> None:
        self._cache = ByteLRUCache(cache_bytes)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if event_log < 0:
            raise ValueError(f"event_log must be >= 0, got {event_log!r}")
        self._timeout = timedelta(seconds=timeout)
        self._group = group
        if dist.is_available() and dist.is_initialized():
            self._rank = dist.get_rank(group)
            self._world = dist.get_world_size(group)
        elif group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        else:
            self._rank, self._world = 0, 1
        self._records: dict[str, _Record] = {}
        self._host: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._queue: list[_Request] = []
        self._hosted: dict[tuple[int, int], torch.Tensor] = {}
        self._directory: dict[tuple[int, int], tuple[int, int]] = {}
        self._incoming: dict[tuple[int, int], torch.Tensor] = {}
        self._next_key = 0
        self._step = 0
        self._broken: str | None = None
        self.events: collections.deque[PoolEvent] = collections.deque(maxlen=event_log)
        self._hits = self._misses = self._transfers = self._moved = self._evictions = 0

    # ----------------------------------------------------------------------------- queries

    @property
    def rank(self) -> int:
        """This rank in the pool's group."""
        return self._rank

    @property
    def step(self) -> int:
        """Number of exchanges completed."""
        return self._step

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def names(self) -> list[str]:
        """The names this rank has put (and not deleted), in insertion order."""
        return list(self._records)

    def placement_of(self, name: str) -> Placement:
        """Where ``name`` is stored. Raises KeyError for an unknown name."""
        return self._record(name).placement

    def handle(self, name: str) -> RemoteTensor:
        """A :class:`RemoteTensor` for ``name``. Raises KeyError for an unknown name."""
        record = self._record(name)
        return RemoteTensor(self, name, record.shape, record.dtype)

    def usage(self) -> PoolUsage:
        """An exact report of what the pool holds now (see :class:`PoolUsage`)."""
        held: dict[str, int] = {}
        for name, record in self._records.items():
            if isinstance(record.placement, Peer) and not record.shipped:
                continue
            if isinstance(record.placement, Host):
                assert self._host[name].numel() == record.nbytes
            key = str(record.placement)
            held[key] = held.get(key, 0) + record.nbytes
        hosted: dict[int, int] = {}
        for (client, _), buffer in self._hosted.items():
            hosted[client] = hosted.get(client, 0) + buffer.numel()
        return PoolUsage(
            held_bytes=held,
            staged_bytes=sum(t.numel() for t in self._staged.values()),
            hosted_bytes=hosted,
            cache_bytes=self._cache.bytes,
            cache_limit=self._cache.limit,
            cache_entries=len(self._cache),
            hits=self._hits,
            misses=self._misses,
            transfers=self._transfers,
            bytes_transferred=self._moved,
            evictions=self._evictions,
        )

    # ------------------------------------------------------------------------ local calls

    def put(
        self, name: str, tensor: torch.Tensor, *, placement: Placement | None = None
    ) -> RemoteTensor:
        """Store a copy of ``tensor`` under ``name`` at ``placement`` (default ``Host()``).

        Putting an existing name replaces its value (same dtype and shape) and may move it to
        another placement; its cached copy is dropped. A ``Peer`` put is staged here and
        shipped by the next :meth:`exchange`.

        Postconditions: ``placement_of(name) == placement``; ``name`` is not cached; later
        reads return ``tensor``'s values bit for bit (``tensor`` may be modified freely).

        Raises:
            TypeError: ``name`` is not a non-empty str, ``tensor`` is not a tensor, the
                placement is not Host/Peer, or ``name`` exists with another dtype.
            ValueError: a non-strided or meta tensor, ``name`` exists with another shape, the
                tensor is larger than the cache bound, or a bad peer rank.
            RuntimeError: a Peer placement without an initialized process group.
        """
        self._check_usable()
        if not isinstance(name, str) or not name:
            raise TypeError(f"a pool name must be a non-empty str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put({name!r}) takes a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_meta:
            raise ValueError(
                f"put({name!r}) takes a dense tensor with data, got layout={tensor.layout}, "
                f"device={tensor.device}"
            )
        placement = Host() if placement is None else placement
        self._check_placement(name, placement)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self._cache.limit:
            raise ValueError(
                f"put({name!r}): the tensor has {nbytes} bytes, more than the cache bound of "
                f"{self._cache.limit} bytes, so it could never be fetched for use"
            )
        old = self._records.get(name)
        if old is not None:
            if tensor.dtype != old.dtype:
                raise TypeError(
                    f"put({name!r}): the pool holds it as {old.dtype}, got {tensor.dtype}; "
                    "delete it first to change its dtype"
                )
            if tensor.shape != old.shape:
                raise ValueError(
                    f"put({name!r}): the pool holds it with shape {tuple(old.shape)}, got "
                    f"{tuple(tensor.shape)}; delete it first to change its shape"
                )
        data = _as_bytes(tensor)
        if old is not None:
            self.evict(name)
        if old is not None and old.placement != placement:
            self._release(name, old)
            old = None
        if isinstance(placement, Host):
            self._host[name] = data
            key = -1
        else:
            key = old.key if old is not None else self._new_key()
            self._queue = [r for r in self._queue if not (r.key == key and r.kind == _STORE)]
            self._queue.append(_Request(_STORE, placement.rank, key, nbytes, name))
            self._staged[name] = data
        self._records[name] = _Record(tensor.shape, tensor.dtype, nbytes, placement, key, False)
        self._log("put", name)
        return RemoteTensor(self, name, tensor.shape, tensor.dtype)

    def prefetch(self, names: Iterable[str]) -> None:
        """Start fetching ``names`` into the cache (LRU entries are evicted to make room).

        Host tensors are copied now; Peer tensors are queued and posted by the next
        :meth:`exchange`. A cached name is only marked recently used. Logs
        ``prefetch_issued`` for every name.

        Postcondition: every name is cached (QUEUED, IN_FLIGHT or READY) and
        ``cache_bytes <= cache_limit``.

        Raises:
            KeyError: an unknown name.
            ValueError: the names together exceed the cache bound.
            RuntimeError: a Peer tensor whose put was not shipped yet (call exchange first).
        """
        self._check_usable()
        batch = list(dict.fromkeys(names))
        records = [self._record(name) for name in batch]
        total = sum(r.nbytes for r in records)
        if total > self._cache.limit:
            raise ValueError(
                f"prefetch of {len(batch)} tensors needs {total} bytes, more than the cache "
                f"bound of {self._cache.limit} bytes; prefetch fewer at a time"
            )
        for name, record in zip(batch, records, strict=True):
            self._log("prefetch_issued", name)
            if name in self._cache:
                self._cache.touch(name)
                continue
            self._require_shipped(name, record)
            self._fetch(name, record, protected=batch)

    def get(self, name: str) -> torch.Tensor:
        """The cached copy of ``name`` (bit-equal to the last put), fetched if need be.

        A cached name is a hit (an in-flight receive is waited for, with the timeout); an
        uncached Host name is a miss and is copied now. An uncached Peer name is a miss and an
        error: peer reads need a prefetch and an exchange first. Logs ``used``.

        Postcondition: ``name`` is cached, READY and most recently used.

        Raises:
            KeyError: an unknown name.
            RuntimeError: a Peer name not prefetched, or prefetched but not yet exchanged.
            TimeoutError: the receive did not complete in time (the pool is then broken).
        """
        self._check_usable()
        record = self._record(name)
        entry = self._cache.lookup(name)
        if entry is None:
            self._misses += 1
            if isinstance(record.placement, Peer):
                raise RuntimeError(
                    f"get({name!r}): it lives on rank {record.placement.rank} and is not "
                    "cached; call prefetch([name]) and then exchange() on every rank first"
                )
            entry = self._fetch(name, record, protected=())
        else:
            self._hits += 1
            if entry.state is CacheState.QUEUED:
                raise RuntimeError(
                    f"get({name!r}): its prefetch from {record.placement} is queued but not "
                    "posted; every rank must call exchange() before get"
                )
            self._complete(entry)
            self._cache.touch(name)
        self._log("used", name)
        assert entry.value is not None
        return entry.value

    def evict(self, name: str) -> bool:
        """Drop the cached copy of ``name`` (waiting for its receive if in flight).

        Returns True if a copy was cached. Postcondition: ``name`` is not cached.

        Raises:
            KeyError: an unknown name.
        """
        self._check_usable()
        self._record(name)
        entry = self._cache.lookup(name)
        if entry is None:
            return False
        if entry.state is CacheState.QUEUED:
            self._queue = [r for r in self._queue if not (r.name == name and r.kind == _FETCH)]
        elif entry.state is CacheState.IN_FLIGHT:
            self._complete(entry)
        self._cache.remove(name)
        self._evictions += 1
        self._log("evicted", name)
        return True

    def delete(self, name: str) -> None:
        """Forget ``name``: drop its cached copy and its storage (a peer frees it at the next
        exchange). Postcondition: ``name not in pool``.

        Raises:
            KeyError: an unknown name.
        """
        record = self._record(name)
        self.evict(name)
        self._release(name, record)
        del self._records[name]
        self._log("deleted", name)

    # -------------------------------------------------------------------------- collective

    def exchange(self) -> None:
        """Serve every rank's queued peer requests (a collective of the pool's group).

        Every rank of the group must call it at the same points; see the module docstring for
        the protocol. Postconditions: this rank's queue is empty; its staged puts are shipped
        (``held_bytes`` counts them); its queued prefetches are IN_FLIGHT (or READY if empty);
        the holder side of every request addressed to this rank is done.

        Raises:
            RuntimeError: no process group, or an invalid request (same error on every rank).
            TimeoutError: a collective or transfer did not finish in time (pool broken).
        """
        self._check_usable()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("exchange() needs an initialized torch.distributed process group")
        for entry in self._cache.entries():
            if entry.state is CacheState.IN_FLIGHT:
                self._complete(entry)
        rows = self._announce()
        sends, holder_recvs, client_recvs = self._post(rows)
        for work, what in sends:
            self._wait(work, what)
        for work, what in holder_recvs:
            self._wait(work, what)
        self._apply(rows, client_recvs)
        self._queue = []
        self._step += 1
        self._log("exchange", "")

    def _announce(self) -> list[list[tuple[int, int, int, int]]]:
        """All-gather every rank's queued requests; rows per client rank."""
        mine = torch.tensor(
            [[r.kind, r.holder, r.key, r.nbytes] for r in self._queue], dtype=torch.int64
        ).reshape(-1, 4)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world)]
        own_count = torch.tensor([len(self._queue)], dtype=torch.int64)
        self._collective(dist.all_gather(counts, own_count, group=self._group, async_op=True))
        longest = max(int(c.item()) for c in counts)
        if longest == 0:
            return [[] for _ in range(self._world)]
        padded = torch.zeros(longest, 4, dtype=torch.int64)
        padded[: len(self._queue)] = mine
        gathered = [torch.empty(longest, 4, dtype=torch.int64) for _ in range(self._world)]
        self._collective(dist.all_gather(gathered, padded, group=self._group, async_op=True))
        return [
            [(int(a), int(b), int(c), int(d)) for a, b, c, d in g[: int(n.item())].tolist()]
            for g, n in zip(gathered, counts, strict=True)
        ]

    def _validate(self, rows: list[list[tuple[int, int, int, int]]]) -> None:
        """Check every request against the mirrored directory and update it (all ranks alike)."""
        directory = dict(self._directory)
        for client, requests in enumerate(rows):
            for kind, holder, key, nbytes in requests:
                where = f"{_KIND_NAMES.get(kind, kind)} from rank {client} to rank {holder}"
                if kind not in _KIND_NAMES or not 0 <= holder < self._world or holder == client:
                    raise RuntimeError(f"exchange(): invalid request {where} (key {key})")
                known = directory.get((client, key))
                if kind == _STORE:
                    if known is not None and known[0] != holder:
                        raise RuntimeError(f"exchange(): {where}: key {key} lives elsewhere")
                    directory[(client, key)] = (holder, nbytes)
                elif known != (holder, nbytes):
                    raise RuntimeError(
                        f"exchange(): {where}: key {key} is not stored there with {nbytes} bytes"
                    )
                elif kind == _FREE:
                    del directory[(client, key)]
        self._directory = directory

    def _post(
        self, rows: list[list[tuple[int, int, int, int]]]
    ) -> tuple[list[tuple[dist.Work, str]], list[tuple[dist.Work, str]], dict[int, dist.Work]]:
        """Post this rank's transfers of the step; nothing is waited for here."""
        self._validate(rows)
        sends: list[tuple[dist.Work, str]] = []
        holder_recvs: list[tuple[dist.Work, str]] = []
        client_recvs: dict[int, dist.Work] = {}
        own = dict(enumerate(self._queue))
        tag = 0
        self._incoming = {}
        for client, requests in enumerate(rows):
            for index, (kind, holder, key, nbytes) in enumerate(requests):
                if kind == _FREE or nbytes == 0 or self._rank not in (client, holder):
                    continue
                what = f"{_KIND_NAMES[kind]} of {nbytes} bytes, rank {client} <-> rank {holder}"
                if kind == _STORE and self._rank == client:
                    data = self._staged[own[index].name]
                    sends.append((self._isend(data, holder, tag), what))
                elif kind == _STORE:
                    buffer = torch.empty(nbytes, dtype=torch.uint8)
                    self._incoming[(client, key)] = buffer
                    holder_recvs.append((self._irecv(buffer, client, tag), what))
                elif self._rank == holder:
                    sends.append((self._isend(self._hosted[(client, key)], client, tag), what))
                else:
                    entry = self._cache.lookup(own[index].name)
                    assert entry is not None
                    assert entry.state is CacheState.QUEUED
                    client_recvs[index] = self._irecv(entry.buffer, holder, tag)
                tag += 1
        return sends, holder_recvs, client_recvs

    def _apply(
        self, rows: list[list[tuple[int, int, int, int]]], client_recvs: dict[int, dist.Work]
    ) -> None:
        """After the waits: install holder buffers, drop staged copies, mark fetches posted."""
        for client, requests in enumerate(rows):
            for kind, holder, key, nbytes in requests:
                if holder != self._rank:
                    continue
                if kind == _STORE:
                    empty = torch.empty(0, dtype=torch.uint8)
                    self._hosted[(client, key)] = (
                        self._incoming.pop((client, key)) if nbytes else empty
                    )
                elif kind == _FREE:
                    del self._hosted[(client, key)]
        self._incoming = {}
        for index, request in enumerate(self._queue):
            if request.kind == _STORE:
                del self._staged[request.name]
                self._records[request.name].shipped = True
            elif request.kind == _FETCH:
                entry = self._cache.lookup(request.name)
                assert entry is not None
                entry.work = client_recvs.get(index)
                entry.state = CacheState.IN_FLIGHT
                self._log("transfer_posted", request.name)
                if entry.work is None:  # an empty tensor: nothing to receive
                    self._complete(entry)

    # ---------------------------------------------------------------------------- helpers

    def _record(self, name: str) -> _Record:
        record = self._records.get(name)
        if record is None:
            known = ", ".join(repr(n) for n in list(self._records)[:8]) or "none"
            raise KeyError(f"no tensor named {name!r} in the pool (rank {self._rank}; has {known})")
        return record

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PoolBrokenError(f"the pool is broken by an earlier timeout: {self._broken}")

    def _check_placement(self, name: str, placement: Placement) -> None:
        if isinstance(placement, Host):
            return
        if not isinstance(placement, Peer):
            raise TypeError(
                f"put({name!r}): placement must be Host() or Peer(rank), got {placement!r}"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"put({name!r}, placement={placement}) needs a process group")
        if placement.rank >= self._world or placement.rank == self._rank:
            raise ValueError(
                f"put({name!r}): Peer({placement.rank}) must name another rank of the group "
                f"(world size {self._world}, this rank {self._rank}); use Host() for this rank"
            )

    def _require_shipped(self, name: str, record: _Record) -> None:
        if isinstance(record.placement, Peer) and not record.shipped:
            raise RuntimeError(
                f"prefetch({name!r}): its put to {record.placement} is not shipped yet; every "
                "rank must call exchange() first"
            )

    def _new_key(self) -> int:
        self._next_key += 1
        return self._next_key

    def _release(self, name: str, record: _Record) -> None:
        """Free the storage of ``record``: at once for Host; for Peer, cancel its queued
        requests and drop its staged copy, and queue a FREE if the holder has the key."""
        if isinstance(record.placement, Host):
            del self._host[name]
            return
        self._queue = [r for r in self._queue if r.key != record.key]
        self._staged.pop(name, None)
        if (self._rank, record.key) in self._directory:
            holder = record.placement.rank
            self._queue.append(_Request(_FREE, holder, record.key, record.nbytes, name))

    def _fetch(self, name: str, record: _Record, protected: Iterable[str]) -> CacheEntry:
        """Make room and add a cache entry: READY for Host, QUEUED (request queued) for Peer."""
        for victim in self._cache.victims(record.nbytes, protected):
            self.evict(victim)
        if isinstance(record.placement, Host):
            buffer = self._host[name].clone()
            entry = CacheEntry(name, record.nbytes, buffer, CacheState.READY)
            entry.value = _typed(buffer, record.shape, record.dtype)
            self._cache.insert(entry)
            self._count_transfer(record.nbytes)
            self._log("ready", name)
            return entry
        buffer = torch.empty(record.nbytes, dtype=torch.uint8)
        entry = CacheEntry(name, record.nbytes, buffer, CacheState.QUEUED)
        self._cache.insert(entry)
        rank = record.placement.rank
        self._queue.append(_Request(_FETCH, rank, record.key, record.nbytes, name))
        return entry

    def _complete(self, entry: CacheEntry) -> None:
        """Wait for an IN_FLIGHT entry's receive and make it READY (no-op when READY)."""
        if entry.state is CacheState.READY:
            return
        assert entry.state is CacheState.IN_FLIGHT
        record = self._records[entry.name]
        if entry.work is not None:
            self._wait(entry.work, f"FETCH of {entry.name!r} from {record.placement}")
        entry.work = None
        entry.value = _typed(entry.buffer, record.shape, record.dtype)
        entry.state = CacheState.READY
        self._count_transfer(entry.nbytes)
        self._log("ready", entry.name)

    def _count_transfer(self, nbytes: int) -> None:
        self._transfers += 1
        self._moved += nbytes

    def _isend(self, data: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = dist.isend(data, group=self._group, group_dst=peer, tag=tag)
        assert work is not None
        return work

    def _irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = dist.irecv(buffer, group=self._group, group_src=peer, tag=tag)
        assert work is not None
        return work

    def _collective(self, work: dist.Work | None) -> None:
        assert work is not None
        self._wait(work, "the request all-gather (does every rank call exchange()?)")

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            self._broken = f"rank {self._rank}, step {self._step}: {what}: {exc}"
            raise TimeoutError(
                f"TensorPool: {what} failed or did not complete within "
                f"{self._timeout.total_seconds()} s "
                f"(rank {self._rank}, exchange step {self._step}); the pool is now broken"
            ) from exc

    def _log(self, kind: str, name: str) -> None:
        self.events.append(PoolEvent(kind, name, self._step))
