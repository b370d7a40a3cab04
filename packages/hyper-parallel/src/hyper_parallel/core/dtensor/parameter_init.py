"""Deferred initialization under upstream's names: build under :func:`no_init_parameters`
(tensors on ``meta``, nothing allocated), shard, then :func:`init_parameters` writes each rank's
piece of a single-device initialization (``hp_dtensor.parallel.materialize``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from hp_dtensor.parallel import materialize
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["init_parameters", "no_init_parameters"]

_M = TypeVar("_M", bound=nn.Module)


@adapts("hp_dtensor.parallel.materialize", "each rank's piece of a single-device init")
def init_parameters(
    module: _M,
    stage_index: int = 0,
    *,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> _M:
    """Materialize every ``meta`` parameter and buffer of ``module`` (built under
    :func:`no_init_parameters`, possibly sharded since) with the values a single-device
    construction under the same random state gives, each rank keeping its piece.

    Args:
        module: the model.
        stage_index: upstream's pipeline-stage offset of the initialization; only 0.
        device: where the tensors go (default: the current accelerator, else the CPU).
        seed: ``torch.manual_seed(seed)`` first (default: the current generator state, which
            must be the same on every rank, as for the single-device construction).

    Returns:
        ``module``, materialized in place.

    Raises:
        NotOfferedError: ``stage_index`` other than 0.
        hp_dtensor.parallel.MaterializeError: a module has no initializer.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"init_parameters needs an nn.Module, got {type(module).__name__}")
    if stage_index != 0:
        raise not_offered(
            f"init_parameters(stage_index={stage_index})",
            "initialize each pipeline stage's module with "
            "hp_dtensor.parallel.materialize(stage_module, seed=...) after seeding as its "
            "single-device construction would",
        )
    if device is None:
        accelerator = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        device = accelerator if accelerator is not None else torch.device("cpu")
    materialize(module, device, seed=seed)
    return module


@adapts(
    "hp_dtensor.parallel.materialize",
    "builds on `meta` (upstream imports it from `mindspore.nn.utils`)",
)
@contextmanager
def no_init_parameters() -> Iterator[None]:
    """Build modules without allocating or initializing their tensors (they are created on the
    ``meta`` device); shard them, then call :func:`init_parameters`.

    Upstream imports this from ``mindspore.nn.utils``; here it is ``torch.device("meta")``.
    """
    with torch.device("meta"):
        yield
