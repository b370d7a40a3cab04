"""Production-mode forwards of the built-in styles whose local computation differs from the
module's own: a row-parallel linear (the bias counted once), a vocabulary-parallel embedding,
sequence-parallel dropout. Each style returns its forward from
:meth:`~hp_dtensor.parallel.styles.ParallelStyle.production_forward`; plain local tensors in and
out, no DTensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel._boundary import BoundaryConverter
from hp_dtensor.parallel.plan import ShardingPlan
from hp_layout import Replicate

__all__ = [
    "rowwise_linear_forward",
    "sequence_parallel_dropout_forward",
    "vocab_parallel_embedding_forward",
]


def rowwise_linear_forward(coordinate: int) -> Callable[..., torch.Tensor]:
    # Every rank's local product is a partial sum; the bias must be counted once. The other
    # ranks still add it times zero: their (zero) bias gradient then arrives too, so every rank
    # reduces the same gradient bucket in backward (a rank without it would leave the others'
    # reduction without a partner).
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias: torch.Tensor | None = self.bias
        if bias is not None and coordinate != 0:
            bias = bias * 0.0
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
