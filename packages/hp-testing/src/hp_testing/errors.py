"""Exceptions raised by :class:`hp_testing.RankPool`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class RankPoolError(RuntimeError):
    """Base class of the errors a :class:`~hp_testing.RankPool` raises for a task."""


class RankFailure(RankPoolError):  # noqa: N818 (the name says what happened)
    """A task raised on one or more ranks, or a worker process died.

    Attributes:
        failures: rank -> formatted traceback (or what is known about a dead worker), in the
            order the message lists them: dead workers first, then ranks in the order their
            errors happened. The first entry is usually the root cause.
        unanswered: ranks that had not answered when the pool gave up waiting after the first
            failure (typically blocked in a collective with a failed rank); they were killed.
    """

    def __init__(
        self, message: str, failures: Mapping[int, str], unanswered: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures)
        self.unanswered: tuple[int, ...] = tuple(unanswered)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The failing ranks, first failure first."""
        return tuple(self.failures)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failures, self.unanswered))


class RankTimeout(RankPoolError, TimeoutError):  # noqa: N818
    """A task did not finish on every rank within its timeout.

    Attributes:
        ranks: the ranks that did not answer in time.
        timeout: the timeout in seconds.
        stacks: rank -> Python stack dump of that rank taken just before it was killed (only
            where one could be taken; POSIX only).
    """

    def __init__(
        self,
        message: str,
        ranks: Sequence[int],
        timeout: float,
        stacks: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.timeout = timeout
        self.stacks: dict[int, str] = dict(stacks or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.ranks, self.timeout, self.stacks))
