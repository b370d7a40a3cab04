"""Greedy, order-preserving bucketing by bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["plan_buckets"]

K = TypeVar("K")


def plan_buckets(items: Sequence[tuple[K, int]], bucket_bytes: int) -> list[list[K]]:
    """Split ``(key, nbytes)`` items, in order, into consecutive buckets of at most
    ``bucket_bytes`` each.

    Postconditions: the concatenated buckets are the keys in input order; no bucket is empty;
    a bucket exceeds ``bucket_bytes`` only when it holds a single item larger than that.

    Raises:
        ValueError: ``bucket_bytes`` is not positive or an item has negative size.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[K]] = []
    current: list[K] = []
    size = 0
    for key, nbytes in items:
        if nbytes < 0:
            raise ValueError(f"item {key!r} has negative size {nbytes}")
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
