"""``torch.chunk`` split arithmetic, without torch.

A dimension of length ``n`` split into ``p`` parts gives every part ``ceil(n / p)`` elements
except at the end, where parts may be shorter or empty. That is what ``torch.chunk`` returns
(padded with empty parts up to ``p``) and what ``torch.distributed.tensor.Shard`` uses, so
layouts computed here agree with PyTorch's.
"""

from __future__ import annotations

__all__ = ["chunk_bounds", "chunk_length", "chunk_sizes"]


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """Return ``(start, stop)`` of part ``index`` when ``length`` elements split into ``parts``.

    Postconditions: ``0 <= start <= stop <= length``; the parts for ``index = 0 .. parts - 1``
    are contiguous, ordered and tile ``[0, length)`` exactly; every part has at most
    ``ceil(length / parts)`` elements.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"index must be in [0, {parts}), got {index}")
    if length < 0:
        raise ValueError(f"length must be non-negative, got {length}")
    size = -(-length // parts)
    start = min(index * size, length)
    stop = min(start + size, length)
    return start, stop


def chunk_length(length: int, parts: int, index: int) -> int:
    """Number of elements in part ``index`` (see :func:`chunk_bounds`)."""
    start, stop = chunk_bounds(length, parts, index)
    return stop - start


def chunk_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Return the length of each of the ``parts`` parts of ``length`` elements (see above)."""
    return tuple(chunk_length(length, parts, i) for i in range(parts))
