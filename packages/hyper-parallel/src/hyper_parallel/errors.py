"""The one error type of the umbrella: an upstream HyperParallel argument or feature that this
stack does not offer. The message always names what to use instead."""

from __future__ import annotations

__all__ = ["NotOfferedError", "not_offered"]


class NotOfferedError(NotImplementedError):
    """An upstream HyperParallel argument, value or feature with no meaning here (MindSpore or
    Ascend specifics, options of an engine this stack does not have).

    The message names the upstream spelling and what to use in this stack instead.
    """


def not_offered(what: str, instead: str) -> NotOfferedError:
    """The :class:`NotOfferedError` for ``what`` (the upstream spelling, e.g.
    ``"fully_shard(sharded_accumulated_grad=True)"``), pointing at ``instead``."""
    return NotOfferedError(f"hyper_parallel: {what} is not offered here; {instead}")
