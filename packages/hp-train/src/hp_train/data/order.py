"""The deterministic choices of the data pipeline: which documents are held out, and the
shuffles of documents and windows.

Every choice is a pure function of integer keys (the seed, an epoch, a row, ...) through
SplitMix64, written here rather than taken from numpy's or torch's generators: their streams
may change between releases, and a checkpoint's data position must mean the same batches in
every later version.
"""

from __future__ import annotations

__all__ = ["is_held_out", "mix64", "permutation"]

_MASK = (1 << 64) - 1
# What a key is for, so that the same (seed, n) never draws the same numbers twice.
HELD_OUT, DOCUMENTS, WINDOWS, SYNTHETIC = 1, 2, 3, 4


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix64(*keys: int) -> int:
    """A 64-bit hash of ``keys`` (negative keys are taken modulo 2**64)."""
    h = 0
    for key in keys:
        h = _splitmix(h ^ (key & _MASK))
    return h


def permutation(n: int, *keys: int) -> list[int]:
    """A permutation of ``range(n)`` drawn from ``keys`` (Fisher-Yates).

    Postcondition: the same ``(n, keys)`` give the same list in every process and version.
    """
    order = list(range(n))
    state = mix64(*keys)
    for i in range(n - 1, 0, -1):
        state = _splitmix(state)
        # The top bits of state * (i + 1) / 2**64: uniform on [0, i] up to 2**-64.
        j = (state * (i + 1)) >> 64
        order[i], order[j] = order[j], order[i]
    return order


def is_held_out(row: int, seed: int, fraction: float) -> bool:
    """Whether document ``row`` (its place in the source's natural order, counted from 0) is
    in the held-out split of a run with ``seed`` that holds out ``fraction`` of the documents.

    Each document is held out independently with probability ``fraction``, so the split needs
    no count of the documents (a streamed source has none until it is read) and a document's
    side never depends on the others.
    """
    if fraction <= 0.0:
        return False
    # 53 bits: the uniform doubles on [0, 1).
    return (mix64(seed, HELD_OUT, row) >> 11) * 2.0**-53 < fraction
