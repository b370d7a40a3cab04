"""Upstream's ``DTensor``: hp-dtensor's, with ``from_local`` communicating only when asked.

hp-dtensor's ``DTensor.from_local`` checks by default that the ranks agree on shapes and
dtypes (``run_check=True``, one small collective over the mesh), so every rank of the mesh must
call it. Upstream's does not communicate (nor does torch's by default), and upstream's own
pipeline example calls it on the first stage only. This class keeps that: its ``from_local``
defaults to ``run_check=False``. It is the same type for every other purpose: any hp-dtensor
DTensor is an instance of it, and what it builds is an ``hp_dtensor.DTensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import hp_dtensor
from hp_dtensor import DeviceMesh
from hp_layout import Placement
from hyper_parallel.migration import adapts

__all__ = ["DTensor"]


class _SameAsHpDTensor(type(hp_dtensor.DTensor)):  # type: ignore[misc]
    """isinstance / issubclass answer as for ``hp_dtensor.DTensor``."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, hp_dtensor.DTensor)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, hp_dtensor.DTensor)


@adapts(
    "hp_dtensor.DTensor",
    "upstream's `from_local` never communicates: `run_check=False` by default (hp-dtensor checks)",
)
class DTensor(hp_dtensor.DTensor, metaclass=_SameAsHpDTensor):
    """``hp_dtensor.DTensor`` as upstream's API has it (see the module docstring)."""

    @classmethod
    def from_local(
        cls,
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int] | None = None,
        shard_order: Sequence[str] | None = None,
        run_check: bool = False,
    ) -> hp_dtensor.DTensor:
        """``hp_dtensor.DTensor.from_local`` with ``run_check=False`` by default (no collective
        where ``shape`` is given or nothing is sharded); pass ``run_check=True`` for the
        check."""
        return hp_dtensor.DTensor.from_local(
            local_tensor,
            device_mesh,
            placements,
            shape=shape,
            shard_order=shard_order,
            run_check=run_check,
        )
