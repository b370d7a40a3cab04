"""Sharding rules for factories that take a DTensor: ``*_like`` and ``Tensor.new_*``.

* ``zeros_like``, ``ones_like``, ``empty_like``, ``full_like``, ``rand_like``, ``randn_like``,
  ``randint_like``: the output has the input's layout, except that Partial axes become
  Replicate (a constant is not a partial value: a ``Partial(sum)`` of ones on every rank would
  mean ``world``, not one). Each rank creates its own local shard (the local call sees the
  local tensor, so the local shape is right for uneven, empty and RaggedShard shards). The
  input is not redistributed: only its shape is read.
* ``Tensor.new_zeros``, ``new_ones``, ``new_empty``, ``new_full``, ``new_tensor`` on a DTensor:
  a *Replicate* DTensor of the given global size (or of ``data``) on the same mesh; every rank
  creates the whole tensor. Shard it afterwards with ``redistribute`` if needed.

Randomness (``rand_like``, ``randn_like``, ``randint_like``): every rank draws its local shard
from its own global RNG, so ranks that must hold identical data (along Replicate axes) need
identical RNG states, which they have when seeded identically and when they have drawn the same
numbers since. Values equal to a single-device run under sharding need a distributed RNG, a
separate feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor.rules._common import replicate_axes_where
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Layout, Replicate

__all__: list[str] = []


def _only_input(call: OpCall) -> Layout:
    layouts = call.layouts
    first: Layout | None = layouts[0] if len(layouts) == 1 else None
    if first is None or not call.args or call.args[0] is not first:
        raise ShardingRuleError(
            f"{call.describe()}: only the first argument may be a DTensor; pass sizes and "
            "values as Python numbers"
        )
    return first


@register_sharding_rule(
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
)
def _like(call: OpCall) -> ShardingDecision:
    """``*_like``: the input's layout with Partial axes made Replicate; local creation."""
    layout = _only_input(call)
    return ShardingDecision((layout,), replicate_axes_where(layout))


def _size(call: OpCall) -> tuple[int, ...]:
    """The size of ``self.new_x(*size)`` / ``new_x(size)`` / ``new_full(size, value)``."""
    if call.name == "new_tensor":
        data = call.arg(1, "data")
        return tuple(torch.as_tensor(data).shape)
    if call.name == "new_full":
        given: Any = call.arg(1, "size")
    elif "size" in call.kwargs:
        given = call.kwargs["size"]
    else:
        given = call.args[1:]
        if len(given) == 1 and isinstance(given[0], Sequence | torch.Size):
            given = given[0]
    if isinstance(given, int):
        given = (given,)
    return tuple(int(n) for n in given)


@register_sharding_rule(
    torch.Tensor.new_zeros,
    torch.Tensor.new_ones,
    torch.Tensor.new_empty,
    torch.Tensor.new_full,
    torch.Tensor.new_tensor,
)
def _new(call: OpCall) -> ShardingDecision:
    """``self.new_x(size, ...)``: a Replicate DTensor of that global size on self's mesh."""
    layout = _only_input(call)
    shape = _size(call)
    output = Layout(shape, layout.mesh, [Replicate()] * layout.mesh.ndim)
    return ShardingDecision((layout,), output)
