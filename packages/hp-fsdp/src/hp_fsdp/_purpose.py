"""What a collective is issued for: a tag the runtime sets around its collectives and the
counting mode (:mod:`hp_fsdp.counting`, a measuring instrument) reads, so the runtime needs
nothing from the instrument."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["collective_purpose", "current_purpose"]

_PURPOSE = threading.local()


@contextlib.contextmanager
def collective_purpose(purpose: str) -> Iterator[None]:
    """Tag the collectives issued inside with ``purpose`` (recorded by an active
    :class:`hp_fsdp.counting.CountingMode` in ``CollectiveCall.purpose``; costs nothing
    otherwise)."""
    previous = getattr(_PURPOSE, "value", None)
    _PURPOSE.value = purpose
    try:
        yield
    finally:
        _PURPOSE.value = previous


def current_purpose() -> str | None:
    """The innermost :func:`collective_purpose` tag on this thread, or None."""
    value: str | None = getattr(_PURPOSE, "value", None)
    return value
