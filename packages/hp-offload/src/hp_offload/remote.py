"""Placements, :class:`RemoteTensor` handles, and the byte-bounded LRU cache of a pool.

A :class:`RemoteTensor` is a handle to a tensor whose storage lives in a
:class:`~hp_offload.pool.TensorPool`: in this rank's host memory (:class:`Host`) or in another
rank's memory (:class:`Peer`). The handle holds no data; :meth:`RemoteTensor.get` returns the
pool's cached working copy, fetched ahead of use by :meth:`RemoteTensor.prefetch`.

This module holds the pool's plain data types (placements, events, usage reports, cache
entries) and :class:`ByteLRUCache`; the transfers and the peer protocol live in
:mod:`hp_offload.pool`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from hp_offload.pool import TensorPool

__all__ = [
    "ByteLRUCache",
    "CacheEntry",
    "CacheState",
    "Host",
    "Peer",
    "Placement",
    "PoolEvent",
    "PoolUsage",
    "RemoteTensor",
]


@dataclass(frozen=True)
class Host:
    """Placement in this rank's host (CPU) memory. ``str(Host()) == "host"``."""

    def __str__(self) -> str:
        return "host"


@dataclass(frozen=True)
class Peer:
    """Placement in the memory of rank ``rank`` of the pool's process group (not this rank).

    ``str(Peer(1)) == "peer:1"``.

    Raises:
        TypeError: ``rank`` is not an int.
        ValueError: ``rank`` is negative.
    """

    rank: int

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"Peer(rank) takes an int rank, got {type(self.rank).__name__}")
        if self.rank < 0:
            raise ValueError(f"Peer(rank) takes a rank >= 0, got {self.rank}")

    def __str__(self) -> str:
        return f"peer:{self.rank}"


Placement = Host | Peer


@dataclass(frozen=True)
class PoolEvent:
    """One entry of a pool's event log.

    ``kind`` is one of ``put``, ``prefetch_issued`` (a prefetch asked for the tensor: the copy
    was made or the peer request queued), ``transfer_posted`` (an exchange posted the peer
    transfer), ``ready`` (the cached copy is complete), ``used`` (``get`` returned it),
    ``evicted``, ``deleted``, ``exchange`` (name ``""``). ``step`` counts the exchanges done
    before the event.
    """

    kind: str
    name: str
    step: int


@dataclass(frozen=True)
class PoolUsage:
    """What a pool holds, as seen from one rank; every figure is exact.

    Attributes:
        held_bytes: placement (``"host"``, ``"peer:R"``) -> bytes of this rank's tensors stored
            there (peer tensors count once an exchange shipped them).
        staged_bytes: bytes of peer puts waiting for the next exchange (copies on this rank).
        hosted_bytes: client rank -> bytes this rank stores on that rank's behalf.
        cache_bytes: bytes of the cached working copies (queued, in flight or ready).
        cache_limit: the cache bound; ``cache_bytes <= cache_limit`` always.
        cache_entries: number of cached copies.
        hits: ``get`` calls that found a cached copy.
        misses: ``get`` calls that did not.
        transfers: fetches into the cache (host copies and peer receives).
        bytes_transferred: bytes moved by those fetches.
        evictions: cached copies dropped (explicitly or to make room).
    """

    held_bytes: Mapping[str, int]
    staged_bytes: int
    hosted_bytes: Mapping[int, int]
    cache_bytes: int
    cache_limit: int
    cache_entries: int
    hits: int
    misses: int
    transfers: int
    bytes_transferred: int
    evictions: int


class CacheState(enum.Enum):
    """Life of a cached copy: QUEUED (peer request waits for an exchange) -> IN_FLIGHT (the
    receive is posted) -> READY. Host copies are READY at once."""

    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    READY = "ready"


@dataclass(eq=False)
class CacheEntry:
    """A cached working copy: ``buffer`` (flat ``uint8``, ``nbytes`` long) receives the bytes;
    ``work`` is the pending receive while IN_FLIGHT; ``value`` is the typed view once READY."""

    name: str
    nbytes: int
    buffer: torch.Tensor
    state: CacheState
    work: dist.Work | None = None
    value: torch.Tensor | None = field(default=None)


class ByteLRUCache:
    """Cached copies, least recently used first, bounded by ``limit`` bytes.

    Invariant (kept by every method): ``self.bytes == sum of entry nbytes <= self.limit``.

    Raises:
        ValueError: ``limit`` is negative (constructor).
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"the cache bound must be an int >= 0 bytes, got {limit!r}")
        self.limit = limit
        self.bytes = 0
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def lookup(self, name: str) -> CacheEntry | None:
        """The entry of ``name`` or None; recency is unchanged."""
        return self._entries.get(name)

    def touch(self, name: str) -> None:
        """Mark ``name`` most recently used. Raises KeyError if it is not cached."""
        self._entries.move_to_end(name)

    def entries(self) -> list[CacheEntry]:
        """The entries, least recently used first."""
        return list(self._entries.values())

    def victims(self, nbytes: int, protected: Iterable[str] = ()) -> list[str]:
        """Names to evict, LRU first, so that ``nbytes`` more fit; never one in ``protected``.

        Postcondition: evicting the returned names leaves ``self.bytes + nbytes <= limit``.

        Raises:
            ValueError: ``nbytes`` cannot fit even after evicting every unprotected entry.
        """
        keep = set(protected)
        excess = self.bytes + nbytes - self.limit
        chosen: list[str] = []
        for name, entry in self._entries.items():
            if excess <= 0:
                break
            if name not in keep:
                chosen.append(name)
                excess -= entry.nbytes
        if excess > 0:
            raise ValueError(
                f"{nbytes} bytes do not fit in the cache ({self.bytes} of {self.limit} bytes "
                f"used, {len(keep)} entries protected by the current request)"
            )
        return chosen

    def insert(self, entry: CacheEntry) -> None:
        """Add ``entry`` as most recently used.

        Raises:
            ValueError: the name is cached already, or the entry would exceed the bound (call
                :meth:`victims` and evict them first).
        """
        if entry.name in self._entries:
            raise ValueError(f"{entry.name!r} is cached already")
        if self.bytes + entry.nbytes > self.limit:
            raise ValueError(
                f"caching {entry.name!r} ({entry.nbytes} bytes) would exceed the bound "
                f"({self.bytes} of {self.limit} bytes used)"
            )
        self._entries[entry.name] = entry
        self.bytes += entry.nbytes

    def remove(self, name: str) -> CacheEntry:
        """Drop and return the entry of ``name``. Raises KeyError if it is not cached."""
        entry = self._entries.pop(name)
        self.bytes -= entry.nbytes
        return entry


class RemoteTensor:
    """A handle to the tensor ``name`` of ``pool`` (returned by ``TensorPool.put``).

    It holds no data: ``get`` returns the pool's cached working copy (a tensor of ``shape``
    and ``dtype``; writing to it does not change the stored value, ``put`` does). The handle
    stays valid until ``pool.delete(name)``; after that, every method raises KeyError.
    """

    __slots__ = ("_pool", "dtype", "name", "shape")

    def __init__(self, pool: TensorPool, name: str, shape: torch.Size, dtype: torch.dtype) -> None:
        self._pool = pool
        self.name = name
        self.shape = shape
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.shape.numel() * self.dtype.itemsize

    @property
    def placement(self) -> Placement:
        """Where the pool stores the tensor now."""
        return self._pool.placement_of(self.name)

    def prefetch(self) -> None:
        """``pool.prefetch([name])``."""
        self._pool.prefetch([self.name])

    def get(self) -> torch.Tensor:
        """``pool.get(name)``: the cached copy, waiting for a transfer in flight."""
        return self._pool.get(self.name)

    def evict(self) -> bool:
        """``pool.evict(name)``: True if a cached copy was dropped."""
        return self._pool.evict(self.name)

    def __repr__(self) -> str:
        return f"RemoteTensor(name={self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"
