"""Production-mode forwards of the built-in styles whose local computation differs from the
module's own: a row-parallel linear (the bias counted once), a vocabulary-parallel embedding,
sequence-parallel dropout. Each style returns its forward from
:meth:`~hp_dtensor.parallel.styles.ParallelStyle.production_forward`; plain local tensors in and
out, no DTensor.

A linear whose local product is not ``F.linear`` (an FP8 linear, whose scales must be those of
the whole weight) takes part through :class:`SplitAwareLinear`: it is told how its weight is
split once the plan has made it local, and the row-parallel forward calls its own product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.interop import layout_of
from hp_dtensor.parallel._boundary import BoundaryConverter
from hp_dtensor.parallel.plan import ShardingPlan
from hp_dtensor.watchdog import watch
from hp_layout import Layout, Replicate, Shard

__all__ = [
    "SplitAwareLinear",
    "announce_linear_split",
    "rowwise_linear_forward",
    "sequence_parallel_dropout_forward",
    "vocab_parallel_embedding_forward",
]


@runtime_checkable
class SplitAwareLinear(Protocol):
    """An ``nn.Linear`` subclass whose local product depends on how its weight is split
    (e.g. ``hp_kernels.float8.Float8Linear``: its FP8 scales are the whole tensor's).

    ``set_tensor_parallel(group, dim, bounds, index, reduce_max)`` is called once the plan has
    replaced its weight by this rank's piece: ``dim`` 0 (output features, column-parallel) or 1
    (input features, row-parallel), ``bounds`` every rank's ``(start, stop)`` along ``dim`` in
    ``group``-rank order, ``index`` this rank's, ``reduce_max`` an in-place element-wise max
    over ``group`` that the collective watchdog names (what the module reduces over tp).
    ``linear_with_bias(x, bias)`` is its product on the local piece with the given bias instead
    of its own (row-parallel adds it once).
    """

    def set_tensor_parallel(
        self,
        group: Any,
        dim: int,
        bounds: Sequence[tuple[int, int]],
        index: int,
        reduce_max: Callable[[torch.Tensor], None],
    ) -> None: ...

    def linear_with_bias(self, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def announce_linear_split(module: nn.Module, dim: int, axis_mesh: DeviceMesh) -> None:
    """Tell a :class:`SplitAwareLinear` ``module`` whose weight the plan split along ``dim``
    over ``axis_mesh`` (1-d) how it is split; any other module is left alone. Its weight must
    already be the local piece, annotated with its layout."""
    if not isinstance(module, SplitAwareLinear):
        return
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    whole = Layout(layout_of(weight).global_shape, axis_mesh.mesh, [Shard(dim)])
    group = axis_mesh.get_group(0)
    ranks = axis_mesh.group_ranks(0)
    # The group numbers its ranks its own way; the pieces are listed in that order.
    order = sorted(ranks, key=lambda r: dist.get_group_rank(group, r))
    bounds = [whole.local_region(r).box[dim] for r in order]

    def reduce_max(t: torch.Tensor) -> None:
        with watch("all_reduce (split linear's max over tp)", group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    module.set_tensor_parallel(group, dim, bounds, order.index(axis_mesh.get_rank()), reduce_max)


def rowwise_linear_forward(
    coordinate: int, own_product: bool = False
) -> Callable[..., torch.Tensor]:
    """The row-parallel forward: the local product plus the bias on coordinate 0 only;
    ``own_product``: the module is a :class:`SplitAwareLinear` and computes the product itself
    (otherwise ``F.linear``)."""

    # Every rank's local product is a partial sum; the bias must be counted once. The other
    # ranks still add it times zero: their (zero) bias gradient then arrives too, so every rank
    # reduces the same gradient bucket in backward (a rank without it would leave the others'
    # reduction without a partner).
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias: torch.Tensor | None = self.bias
        if bias is not None and coordinate != 0:
            bias = bias * 0.0
        if own_product:
            return cast(SplitAwareLinear, self).linear_with_bias(x, bias)
        return F.linear(x, self.weight, bias)

    return forward


def vocab_parallel_embedding_forward(start: int, stop: int) -> Callable[..., torch.Tensor]:
    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= stop)
        local_ids = torch.where(outside, torch.zeros_like(ids), ids - start)
        padding = self.padding_idx
        local_padding = padding - start if padding is not None and start <= padding < stop else None
        if stop == start:
            # An empty vocabulary shard contributes zeros (still connected to the weight).
            shape = (*ids.shape, self.weight.shape[1])
            return self.weight.sum() * 0 + torch.zeros(shape, dtype=self.weight.dtype)
        out = F.embedding(local_ids, self.weight, local_padding, None, 2.0, False, False)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    return forward


def sequence_parallel_dropout_forward(
    axis_mesh: DeviceMesh, plan: ShardingPlan
) -> Callable[..., torch.Tensor]:
    from hp_dtensor.parallel import random as parallel_random

    boundary = plan.inputs[0]
    assert boundary is not None
    placement = boundary.target
    converter = BoundaryConverter(axis_mesh)

    placement = placement or Replicate()
    rank = axis_mesh.get_rank()

    def forward(self: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        # The layout is learned once per local shape (one tiny all-gather), not per call.
        layout = converter.layout(x, placement)
        return parallel_random.parallel_dropout_forward(self, x, layout, rank)

    return forward
