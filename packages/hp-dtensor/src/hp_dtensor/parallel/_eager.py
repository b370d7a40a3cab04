"""Functions that stay eager inside code ``torch.compile`` traces: the exchanges of context and
expert parallelism (collectives dynamo cannot trace, sizes known only at run time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager_under_compile"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_under_compile(fn: _F) -> _F:
    """``fn`` with ``torch.compiler.disable``: a call to it inside traced code is a graph
    break, and ``fn`` and everything it calls run eager. The signature is kept (torch leaves
    the decorator untyped)."""
    return cast(_F, torch.compiler.disable(fn))
