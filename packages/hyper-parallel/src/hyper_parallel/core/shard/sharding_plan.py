"""``hyper_parallel.core.shard.sharding_plan``: upstream's :class:`ShardingPlan` (placements per
parameter, input and output, keyed by dotted names), which :func:`~hyper_parallel.shard_module`
lowers to hp-dtensor's per-module ``hp_dtensor.parallel.ShardingPlan``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from hp_dtensor import Placement
from hyper_parallel.migration import adapts

__all__ = ["IOPlacements", "ShardingPlan"]

IOPlacements: TypeAlias = (
    Sequence[Placement]
    | Sequence[Sequence[Placement] | None]
    | Mapping[str, Sequence[Placement] | None]
)
"""An ``input_plan``/``output_plan`` value: one placement per mesh axis for the only (or first)
tensor; a sequence of those, one per positional input (or tuple output element; None leaves
one alone); or a mapping from keyword-input names to them."""


@adapts(
    "hp_dtensor.parallel.ShardingPlan",
    "upstream fields `plan=`, `input_plan=`, `output_plan=` (one placement per mesh axis, "
    "keyed by dotted names), lowered per module by `shard_module`",
)
@dataclass
class ShardingPlan:
    """Where a model's parameters, inputs and outputs live on a device mesh (upstream's form).

    Attributes:
        plan: parameter name (dotted from the sharded model, ``"weight"``,
            ``"mlp.up.weight"``) -> one placement per mesh axis.
        input_plan: ``"input"`` (the model) or ``"<submodule>.input"`` -> the placements the
            module's inputs are redistributed to when it is called (see :data:`IOPlacements`).
        output_plan: ``"output"`` or ``"<submodule>.output"`` -> the placements the module's
            outputs are redistributed to.
        return_local_tensor: upstream's modules whose outputs become local tensors; not
            offered (call ``.to_local()`` on the output).
    """

    plan: Mapping[str, Sequence[Placement]] | None = None
    input_plan: Mapping[str, IOPlacements] | None = None
    output_plan: Mapping[str, IOPlacements] | None = None
    return_local_tensor: Sequence[str] | None = None
