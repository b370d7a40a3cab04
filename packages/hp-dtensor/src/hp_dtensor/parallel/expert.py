"""Expert parallelism for mixture-of-experts modules: token dispatch and combine by ragged
all-to-all, and the forwards of the :class:`ExpertParallel` and :class:`ExpertTensorParallel`
styles in both modes. The module is any :class:`~hp_dtensor.parallel.ExpertModule` (the
structure the dispatch reads: router, expert stacks, optional shared experts, ``finish``).

Setup (EP = DP): every rank of the ep axis holds its *own* tokens (the MoE input is
``Shard(0)`` on the ep axis: the global batch is the concatenation of the ranks' batches along
dim 0); the router and the shared experts are replicated; the expert stacks are ``Shard(0)``
(rank ``r`` owns experts ``[r * E / N, (r + 1) * E / N)``). A forward routes the local
tokens, exchanges the per-expert counts (one small all-gather), sends each token copy to the
owner of its expert (all-to-all with uneven splits; no token dropped, no capacity), runs the
local experts on their rows (grouped by expert, ordered by source rank then token), sends the
results back (the reverse all-to-all) and combines them. Each rank's output is the
single-device output of its tokens. Expert ``e`` sees the same rows in the same order as on a
single device given the concatenated batch, so results agree to fp32 rounding.

Gradients: the exchange is an autograd function whose backward is the reverse exchange, so
each rank's local gradients are the adjoint pieces of one global loss; the router's and the
shared experts' gradients are summed over the ep axis (the parallel axis of
``parallelize_module``). The loss convention is therefore: **the global loss is the sum of
the per-rank losses** (each rank's loss is the sum over its tokens divided by the global
token count, not a local mean). The auxiliary load-balance loss follows the same convention:
every rank adds its additive term (global counts, its own scores).

:class:`ExpertTensorParallel` adds a tp axis (EP x TP on a 2-d mesh): each expert's hidden
dim is sharded over tp (``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``), tokens are replicated
over tp, each tp rank computes a partial expert output and the partials are all-reduced over
tp before the combine. In production mode the tp axis follows the Megatron convention (every
tp rank's gradient of a replicated value is exact: identity forward / all-reduce backward at
the expert input, all-reduce forward / identity backward at the output); in validation mode
it follows the DTensor adjoint convention (all-reduce both ways; replicated gradients are
partial sums reduced with the parameters').
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import hp_dtensor._comm as _comm
from hp_dtensor.collectives import _apply, all_reduce, all_to_all_rows
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_dtensor.interop import layout_of
from hp_dtensor.parallel._eager import eager_under_compile
from hp_dtensor.parallel._region import _PartialToExact as _CopyToTp
from hp_dtensor.parallel.expert_module import ExpertModule, expert_module_of
from hp_dtensor.parallel.moe_ops import (
    Routing,
    combine,
    grouped_swiglu,
    route,
    sort_by_expert,
    swiglu,
)
from hp_dtensor.parallel.plan import PlanError
from hp_layout import Layout, ReduceOp, Shard

__all__ = [
    "DispatchPlan",
    "TpConvention",
    "exchange_through_experts",
    "expert_parallel_forward",
    "install_validation_forward",
    "plan_dispatch",
    "regroup_index",
    "run_expert_parallel",
]

TpConvention = Literal["exact", "adjoint"]


# The plan: pure, from the count matrix to sizes -------------------------------------------------


@dataclass(frozen=True)
class DispatchPlan:
    """How one rank's token copies move for one forward.

    Attributes:
        send_sizes: rows sent to each ep coordinate (this rank's expert-sorted rows, in
            order: the rows for coordinate ``j``'s experts are consecutive).
        recv_sizes: rows received from each ep coordinate.
        blocks: ``blocks[i][l]``: rows from coordinate ``i`` for local expert ``l`` (the
            received buffer is these blocks in ``(i, l)`` order).
        expert_counts: rows per local expert after regrouping (``sum_i blocks[i][l]``).
    """

    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    expert_counts: tuple[int, ...]


def plan_dispatch(counts: Sequence[Sequence[int]], coordinate: int) -> DispatchPlan:
    """The dispatch of coordinate ``coordinate`` given ``counts[i][e]``, the rows coordinate
    ``i`` routes to expert ``e`` (``N`` rows of ``E`` counts; ``E`` divisible by ``N``;
    coordinate ``j`` owns experts ``[j * E / N, (j + 1) * E / N)``).

    Postconditions: ``sum(send_sizes) == sum(counts[coordinate])``; ``recv_sizes[i] ==
    sum(blocks[i])``; ``sum(expert_counts) == sum(recv_sizes)``; zero counts are kept (an
    expert or a rank may get no rows).
    """
    ep = len(counts)
    if ep == 0 or not 0 <= coordinate < ep:
        raise ValueError(f"coordinate {coordinate} outside an ep axis of {ep} ranks")
    experts = len(counts[0])
    if any(len(row) != experts for row in counts):
        raise ValueError(
            f"every rank's counts need {experts} entries, got {[len(r) for r in counts]}"
        )
    if experts % ep:
        raise ValueError(
            f"{experts} experts cannot be split evenly over {ep} expert-parallel ranks"
        )
    if any(c < 0 for row in counts for c in row):
        raise ValueError(f"negative token counts {counts}")
    local = experts // ep
    mine = range(coordinate * local, (coordinate + 1) * local)
    own = counts[coordinate]
    send = tuple(sum(own[j * local : (j + 1) * local]) for j in range(ep))
    blocks = tuple(tuple(int(counts[i][e]) for e in mine) for i in range(ep))
    return DispatchPlan(
        send_sizes=tuple(int(s) for s in send),
        recv_sizes=tuple(sum(b) for b in blocks),
        blocks=blocks,
        expert_counts=tuple(sum(blocks[i][e] for i in range(ep)) for e in range(local)),
    )


def regroup_index(plan: DispatchPlan, device: torch.device | None = None) -> torch.Tensor:
    """Received-row index of each row grouped by local expert (then by source coordinate,
    then in order): ``received[index]`` is grouped. A permutation of ``sum(recv_sizes)``."""
    sizes = torch.tensor(plan.blocks, dtype=torch.int64, device=device).reshape(
        len(plan.blocks), -1
    )
    total = int(sizes.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    starts = (sizes.reshape(-1).cumsum(0) - sizes.reshape(-1)).reshape(sizes.shape)
    grouped_sizes = sizes.t().reshape(-1)
    grouped_starts = grouped_sizes.cumsum(0) - grouped_sizes
    shift = torch.repeat_interleave(starts.t().reshape(-1) - grouped_starts, grouped_sizes)
    return torch.arange(total, dtype=torch.int64, device=device) + shift


def _inverse(index: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(index)
    out[index] = torch.arange(index.numel(), dtype=index.dtype, device=index.device)
    return out


# Tensor-parallel entry and exit of the experts (Megatron convention) -----------------------------
# The entry, _CopyToTp (identity forward, gradient summed over tp), is exact_region's
# _PartialToExact.


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: _comm.AxisGroup) -> torch.Tensor:
        return _comm.all_reduce(x.contiguous(), ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# Execution ---------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_expert_parallel(
    moe: ExpertModule,
    x: torch.Tensor,
    mesh: DeviceMesh,
    ep_axis: str,
    tp_axis: str | None = None,
    tp_convention: TpConvention = "exact",
) -> torch.Tensor:
    """The expert-parallel forward of ``moe`` on this rank's tokens ``x`` (plain, ``[..., dim]``).

    ``moe``'s parameters are this rank's shards (plain or DTensor; DTensors are used through
    their local tensors). Returns this rank's output (plain, ``x``'s shape): the single-device
    output of these tokens. Sets ``moe.last_counts`` (global counts) and ``moe.last_aux_loss``
    (this rank's term). Collective over ``ep_axis`` (and ``tp_axis``).

    Under ``torch.compile`` the routing before the exchange and the combine after it (every
    shape there fixed by the token count) are traced; :func:`exchange_through_experts`, whose
    sizes are known only once the counts are exchanged, runs eager between them: one graph
    break per traced forward.
    """
    tokens = x.reshape(-1, moe.dim)
    router = moe.router
    bias = router.expert_bias
    routing = route(
        tokens,
        _local(router.weight),
        router.top_k,
        score_func=router.score_func,
        expert_bias=None if bias is None else _local(bias),
        normalize=router.normalize,
        scale=router.route_scale,
    )
    back, order, global_counts, num_tokens, aux_grad = exchange_through_experts(
        moe, tokens, routing, mesh, ep_axis, tp_axis, tp_convention
    )
    out = combine(back, order, routing.weights)
    if moe.shared is not None:
        shared = moe.shared
        out = out + swiglu(
            tokens, _local(shared.w1.weight), _local(shared.w2.weight), _local(shared.w3.weight)
        )
    out = moe.finish(out, routing.scores, global_counts, num_tokens, aux_grad=aux_grad)
    return out.view_as(x)


@eager_under_compile
def exchange_through_experts(
    moe: ExpertModule,
    tokens: torch.Tensor,
    routing: Routing,
    mesh: DeviceMesh,
    ep_axis: str,
    tp_axis: str | None,
    tp_convention: TpConvention,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
    """The data-dependent middle of :func:`run_expert_parallel`: the count all-gather, the
    token copies to their experts' ranks, the local experts on the rows received and the
    results back. Always eager, also inside code ``torch.compile`` traces (one graph break
    there): every size in it depends on the routing of every rank.

    Returns ``(back, order, global_counts, num_tokens, aux_grad)``: the ``T * k`` expert
    outputs in :func:`sort_by_expert`'s order, that order, the tokens per expert over the ep
    group (also stored in ``moe.last_counts``), the number of tokens over the group and the
    gradient seed of this rank's load-balancing term.
    """
    ep = _comm.AxisGroup.of(mesh, ep_axis)
    counts = _comm.all_gather_dim(routing.counts.unsqueeze(0), 0, [1] * ep.size, ep)
    plan = plan_dispatch(counts.tolist(), ep.index)
    tp = _comm.AxisGroup.of(mesh, tp_axis) if tp_axis is not None else None
    routed = tokens
    if tp is not None and tp_convention == "exact":
        routed = _apply(_CopyToTp)(tokens, tp)
    rows, order = sort_by_expert(routed, routing)
    received = all_to_all_rows(rows, mesh, ep_axis, plan.send_sizes, plan.recv_sizes)
    index = regroup_index(plan, device=rows.device)
    grouped = received.index_select(0, index)
    w1, w2, w3 = (_local(w) for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    y = grouped_swiglu(grouped, list(plan.expert_counts), w1, w2, w3)
    if tp is not None and tp_axis is not None:
        if tp_convention == "exact":
            y = _apply(_ReduceFromTp)(y, tp)
        else:
            y = all_reduce(y, mesh, tp_axis)
    back = all_to_all_rows(
        y.index_select(0, _inverse(index)), mesh, ep_axis, plan.recv_sizes, plan.send_sizes
    )
    global_counts = counts.sum(0)
    moe.last_counts = global_counts
    num_tokens = int(global_counts.sum()) // moe.router.top_k
    # Adjoint convention over tp: the aux term is replicated there, seeded once.
    aux_grad = 0.0 if tp is not None and tp_convention == "adjoint" and tp.index else 1.0
    return back, order, global_counts, num_tokens, aux_grad


# Installation ------------------------------------------------------------------------------


def _axes_from_layout(layout: Layout, ep_axis: str, module: nn.Module, w2: Layout) -> str | None:
    """Check the experts' layout; return the tp axis (None for plain expert parallelism)."""
    names = layout.mesh.axis_names
    placements = dict(zip(names, layout.placements, strict=True))
    if placements.get(ep_axis) != Shard(0):
        raise PlanError(
            f"expert parallelism over {ep_axis!r} needs the expert stacks Shard(0) on it; "
            f"w1 is {layout!r}"
        )
    experts, ep_size = layout.global_shape[0], layout.mesh.axis_size(ep_axis)
    if experts % ep_size:
        raise PlanError(
            f"{type(module).__name__} has {experts} experts, not divisible by the {ep_size} ranks "
            f"of expert-parallel axis {ep_axis!r}; use a number of experts divisible by it"
        )
    tp = [a for a, p in placements.items() if p == Shard(1)]
    w2_placements = dict(zip(names, w2.placements, strict=True))
    if tp and w2_placements.get(tp[0]) != Shard(2):
        raise PlanError(f"expert tensor parallelism over {tp[0]!r} needs w2 Shard(2); got {w2!r}")
    return tp[0] if tp else None


def expert_parallel_forward(module: nn.Module, axis_mesh: DeviceMesh) -> Callable[..., Any]:
    """The production forward of an ``ExpertParallel``/``ExpertTensorParallel`` MoE whose
    parameters are already this rank's annotated shards; ``axis_mesh`` is the ep axis."""
    moe = expert_module_of(module, "expert parallelism", type(module).__name__)
    ep_axis = axis_mesh.mesh_dim_names[0]
    layout = layout_of(moe.experts.w1)
    tp_axis = _axes_from_layout(layout, ep_axis, module, layout_of(moe.experts.w2))
    mesh = DeviceMesh.lookup(axis_mesh.device_type, layout.mesh)

    def forward(self: ExpertModule, x: torch.Tensor) -> torch.Tensor:
        return run_expert_parallel(self, x, mesh, ep_axis, tp_axis, "exact")

    return forward


def install_validation_forward(module: nn.Module, mesh: DeviceMesh, axis: str) -> None:
    """Replace the forward of an expert-parallel MoE in validation mode: the same computation
    as production mode on the local shards of its DTensor parameters and input; the output is
    a DTensor with the input's layout (checked at the boundary)."""
    moe = expert_module_of(module, "expert parallelism", type(module).__name__)
    w1, w2 = moe.experts.w1, moe.experts.w2
    if not isinstance(w1, DTensor) or not isinstance(w2, DTensor):
        raise PlanError("validation mode needs the expert stacks as DTensors")
    tp_axis = _axes_from_layout(w1.dist_layout, axis, module, w2.dist_layout)

    def forward(self: ExpertModule, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor):
            raise PlanError(f"expert-parallel MoE in validation mode got a {type(x).__name__}")
        out = run_expert_parallel(self, x.to_local(), mesh, axis, tp_axis, "adjoint")
        # The MoE keeps its input's layout by construction: no cross-rank check per forward.
        return DTensor.from_local(
            out, x.device_mesh, x.placements, shape=tuple(x.shape), run_check=False
        )

    object.__setattr__(module, "forward", types.MethodType(forward, module))
