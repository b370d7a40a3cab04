"""Context parallelism in a model and a training loop: positions, data sharding and the loss.

The sequence is sharded over a context-parallel (CP) mesh axis (load-balanced "zigzag" by
default, see :mod:`hp_dtensor.parallel.context_plan`). A model runs under CP when

1. its attention goes through a core module (:class:`CausalAttention`, ``q, k, v -> out``)
   that the plan shards with ``ContextParallel(variant="ring" | "ulysses")``;
2. its position embeddings take global positions as an input instead of assuming
   ``range(seq)``: each rank passes :func:`local_positions` (e.g. rotary tables looked up with
   ``F.embedding(positions, cos_table)``);
3. the plan declares, at the root, that the token inputs, the positions and the output are
   sequence-sharded, e.g. ``{"": ShardingPlan(inputs=(Boundary(Shard(1)), Boundary(Shard(0))),
   outputs=Boundary(Shard(1))), "layers.*.attn.core": ContextParallel("ring")}`` with the
   ``cp`` axis as ``parallelize_module``'s ``tp_axis`` (gradients of replicated parameters are
   then summed over it in backward);
4. the loop feeds each rank :func:`shard_sequence` of the ids (and of the targets) and
   computes the loss as the global mean over all tokens: :func:`context_parallel_cross_entropy`
   (sum of local losses divided by the global token count, the same value on every rank) in
   production mode; in validation mode the model's DTensor logits give it with plain
   ``F.cross_entropy`` (the DTensor rule divides by the global count).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import hp_dtensor._comm as _comm
from hp_dtensor._comm import AxisGroup
from hp_dtensor.collectives import _apply, all_gather
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel.context_attention import CausalAttention
from hp_dtensor.parallel.context_plan import SequenceSharding, inverse_permutation
from hp_layout import ReduceOp

__all__ = [
    "CausalAttention",
    "context_parallel_cross_entropy",
    "gather_sequence",
    "global_token_mean",
    "local_positions",
    "sequence_sharding",
    "shard_sequence",
]


def sequence_sharding(
    seq_len: int, mesh: DeviceMesh, axis: str, *, balanced: bool = True
) -> SequenceSharding:
    """The sharding of a ``seq_len`` sequence over ``axis`` of ``mesh`` (raises
    ContextParallelError for lengths that do not split evenly)."""
    return SequenceSharding(seq_len, mesh.size(axis), balanced)


def local_positions(
    seq_len: int,
    mesh: DeviceMesh,
    axis: str,
    *,
    balanced: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's global positions (int64, local order), e.g. to look up rotary tables.

    Postcondition: ``local_positions(...)[j]`` is the global position of local row ``j`` of
    every sequence-sharded tensor on this rank.
    """
    positions = sequence_sharding(seq_len, mesh, axis, balanced=balanced).positions(
        mesh.get_local_rank(axis)
    )
    return torch.tensor(positions, dtype=torch.int64, device=device)


def shard_sequence(
    x: torch.Tensor, dim: int, mesh: DeviceMesh, axis: str, *, balanced: bool = True
) -> torch.Tensor:
    """This rank's rows of a whole-sequence tensor ``x`` along ``dim`` (a copy)."""
    positions = local_positions(x.shape[dim], mesh, axis, balanced=balanced, device=x.device)
    return x.index_select(dim, positions)


def gather_sequence(
    x: torch.Tensor, dim: int, mesh: DeviceMesh, axis: str, *, balanced: bool = True
) -> torch.Tensor:
    """The whole sequence, in natural order, from every rank's shard (collective,
    differentiable: the backward hands each rank the gradient of its rows)."""
    dim = dim % x.dim()
    whole = all_gather(x, dim, mesh, axis)
    sharding = sequence_sharding(whole.shape[dim], mesh, axis, balanced=balanced)
    inverse = inverse_permutation(sharding.permutation())
    return whole.index_select(dim, torch.tensor(inverse, device=x.device))


class _GlobalMean(torch.autograd.Function):
    """Forward: ``sum(local sums) / sum(local counts)`` over the group. Backward (exact
    convention: every rank's upstream gradient is the whole gradient of the global mean): the
    local sum's gradient is ``upstream / global count``, with no collective."""

    @staticmethod
    def forward(
        ctx: Any, local_sum: torch.Tensor, local_count: torch.Tensor, group: AxisGroup
    ) -> torch.Tensor:
        # At least fp32 (a half-precision sum would round the total), never less than the
        # sum's own dtype (a float64 loss stays float64).
        dtype = torch.promote_types(local_sum.dtype, torch.float32)
        both = torch.stack((local_sum.detach().to(dtype), local_count.to(dtype)))
        total = _comm.all_reduce(both, ReduceOp.SUM, group)
        ctx.count = total[1]
        return (total[0] / total[1]).to(local_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad / ctx.count.to(grad.dtype), None, None


def global_token_mean(
    local_sum: torch.Tensor, local_count: torch.Tensor | int, mesh: DeviceMesh, axis: str
) -> torch.Tensor:
    """The mean over every token of the axis: ``sum of local sums / sum of local counts``.

    Postcondition: the same value on every rank of ``axis`` (one all-reduce of two numbers);
    ``loss.backward()`` on every rank gives each rank's ``local_sum`` the gradient
    ``1 / global count`` (production mode's exact convention), so parameter gradients summed
    over the axis are those of the single-device mean.
    """
    count = torch.as_tensor(local_count, device=local_sum.device)
    out: torch.Tensor = _apply(_GlobalMean)(local_sum, count, AxisGroup.of(mesh, axis))
    return out


def context_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of sequence-sharded ``[..., classes]`` logits against ``[...]`` targets,
    averaged over the non-ignored tokens of the whole sequence (all ranks of ``axis``).

    Postcondition: equals ``F.cross_entropy`` of the whole logits and targets (mean
    reduction), on every rank; see :func:`global_token_mean` for the gradient.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    local_sum = F.cross_entropy(
        flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum"
    )
    return global_token_mean(local_sum, (flat_targets != ignore_index).sum(), mesh, axis)
