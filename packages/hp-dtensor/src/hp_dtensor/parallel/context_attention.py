"""Context-parallel causal attention on local sequence shards: Ulysses and ring.

Both take this rank's query, key and value ``[batch, heads, local_seq, head_size]`` (sequence
sharded over a context-parallel mesh axis as a :class:`SequenceSharding` says) and return this
rank's rows of causal attention over the *whole* sequence, differentiably:

* :func:`ulysses_attention`: one all-to-all turns (all heads, local sequence) into (a
  ``1/cp`` share of the heads, whole sequence); the positions are put back in natural order,
  the causal SDPA runs as on one device, and one all-to-all turns the result back. Needs the
  head count divisible by ``cp``. Moves ``3 + 1`` local-size tensors per forward (and as many
  in backward), independent of ``cp``'s effect on attention cost.
* :func:`ring_attention`: key and value blocks rotate around the ring for ``cp - 1`` steps; each
  step attends this rank's queries to the visiting block, blockwise in fp32 with an online
  softmax (running log-sum-exp), skipping the pieces the causal mask hides
  (:meth:`SequenceSharding.ring_blocks`; with the balanced sharding every rank does the same
  work). Autograd runs through the blockwise ops and through :func:`ring_shift`, whose adjoint
  is the reverse rotation, so the backward rotates key/value gradients the other way.
  Memory trade-off: autograd keeps every step's visiting key/value block and its score block,
  i.e. ``O(local_seq * seq)`` scores per head like unfused attention, instead of the
  ``O(local_seq)`` of a flash-style recomputing backward (not implemented).

:class:`CausalAttention` is the core module (``q, k, v -> out``, causal SDPA on one device)
that models use so the :class:`~hp_dtensor.parallel.styles.ContextParallel` style can target it.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor.collectives import _apply, all_to_all, ring_shift
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.parallel._eager import eager_under_compile
from hp_dtensor.parallel.context_plan import (
    BlockKind,
    ContextParallelError,
    ContextParallelPlan,
    SequenceSharding,
    inverse_permutation,
)

__all__ = [
    "CausalAttention",
    "context_parallel_attention",
    "install_validation_forward",
    "production_forward",
    "ring_attention",
    "ulysses_attention",
]


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention, ``[batch, heads, seq, head_size]`` in and out.

    The module form of ``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)``
    (no parameters), so a plan can shard it with ``ContextParallel``.
    """

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_dim: int) -> None:
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ContextParallelError(
            "context-parallel attention needs query, key and value of one shape "
            f"[batch, heads, seq, head_size]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)} (grouped-query heads: repeat the key/value heads first)"
        )
    if seq_dim % 4 != 2:
        raise ContextParallelError(f"the sequence dim must be dim 2, got {seq_dim}")


def _sharding(local_len: int, mesh: DeviceMesh, axis: str, balanced: bool) -> SequenceSharding:
    cp = mesh.size(axis)
    return SequenceSharding(local_len * cp, cp, balanced)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    balanced: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence (module docstring).

    Postcondition: the result equals, at this rank's positions, SDPA with ``is_causal=True``
    of the whole sequence (the same kernel on the same rows: equal to rounding of the
    exchanges, which are exact). Raises ContextParallelError if the heads do not divide by
    the axis size.
    """
    _check_qkv(q, k, v, 2)
    cp = mesh.size(axis)
    heads = q.shape[1]
    if heads % cp:
        raise ContextParallelError(
            f"Ulysses context parallelism shards the {heads} heads over the {cp} ranks of axis "
            f"{axis!r}: the head count must divide by {cp}; use the ring variant instead"
        )
    sharding = _sharding(q.shape[2], mesh, axis, balanced)
    qkv = torch.stack((q, k, v))  # [3, b, h, s_local, d]
    # heads -> sequence: [3, b, h / cp, s, d], sequence in sharded (rank) order
    whole = all_to_all(qkv, 2, 3, mesh, axis)
    perm = sharding.permutation()
    natural_index = None
    if balanced and cp > 1:
        natural_index = torch.tensor(inverse_permutation(perm), device=q.device)
        whole = whole.index_select(3, natural_index)
    out = F.scaled_dot_product_attention(whole[0], whole[1], whole[2], is_causal=True, scale=scale)
    if natural_index is not None:
        out = out.index_select(2, torch.tensor(perm, device=q.device))
    # sequence -> heads: back to [b, h, s_local, d]
    return all_to_all(out, 2, 1, mesh, axis)


def _attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: BlockKind, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(softmax(q k^T) v, logsumexp(q k^T))`` of one block (causal: lower triangle)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind is BlockKind.CAUSAL:
        n = scores.shape[-1]
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, block: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial results over disjoint key sets."""
    if acc is None:
        return block
    out, lse = acc
    b_out, b_lse = block
    new_lse = torch.logaddexp(lse, b_lse)
    merged = out * torch.exp(lse - new_lse).unsqueeze(-1) + b_out * torch.exp(
        b_lse - new_lse
    ).unsqueeze(-1)
    return merged, new_lse


class _Tie(torch.autograd.Function):
    """Identity on ``out`` that also depends on ``blocks`` (zero gradient): every rank's
    backward then runs every reverse rotation, even of a block its queries never saw (the
    contiguous sharding), so no rank waits on a rotation another rank skipped."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(b.shape, b.dtype) for b in blocks]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = (grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.shapes)
        return (grad, *zeros)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    *,
    balanced: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence (module docstring).

    Postcondition: equals SDPA with ``is_causal=True`` of the whole sequence at this rank's
    positions, to fp32 rounding (scores and softmax in fp32; result in ``q``'s dtype).
    """
    _check_qkv(q, k, v, 2)
    cp = mesh.size(axis)
    index = mesh.get_local_rank(axis)
    sharding = _sharding(q.shape[2], mesh, axis, balanced)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf = q.float()
    kv = torch.stack((k, v)).float()
    acc: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
    visitors: list[torch.Tensor] = []
    for step in range(cp):
        if step:
            kv = ring_shift(kv, mesh, axis, 1)  # now holds coordinate (index - step)'s block
            visitors.append(kv)
        owner = (index - step) % cp
        for block in sharding.ring_blocks(index, owner):
            (qa, qb), (ka, kb) = block.q_rows, block.k_rows
            part = _attend_block(
                qf[:, :, qa:qb], kv[0, :, :, ka:kb], kv[1, :, :, ka:kb], block.kind, scale
            )
            acc[(qa, qb)] = _merge(acc.get((qa, qb)), part)
    rows = []
    for piece in sorted(acc):
        merged = acc[piece]
        assert merged is not None
        rows.append(merged[0])
    if sum(r.shape[2] for r in rows) != q.shape[2]:
        raise AssertionError("ring attention left query rows without keys")
    out = torch.cat(rows, dim=2)
    if torch.is_grad_enabled() and visitors and any(t.requires_grad for t in (q, k, v)):
        out = _apply(_Tie)(out, *visitors)
    return out.to(q.dtype)


_VARIANTS: dict[str, Callable[..., torch.Tensor]] = {
    "ring": ring_attention,
    "ulysses": ulysses_attention,
}


@eager_under_compile
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    axis: str,
    plan: ContextParallelPlan,
) -> torch.Tensor:
    """Run ``plan.variant`` on this rank's local shards (both modes call this).

    Always eager, also inside code ``torch.compile`` traces (one graph break there): the
    ring's point-to-point shifts cannot be traced, and they sit inside the loop over ring
    steps, where a graph cannot resume; Ulysses' all-to-alls go through the process group's
    own calls as well.
    """
    return _VARIANTS[plan.variant](q, k, v, mesh, axis, balanced=plan.balanced, scale=plan.scale)


def _scale(module: nn.Module, plan: ContextParallelPlan) -> ContextParallelPlan:
    """The plan with the module's own scale when the style gave none."""
    scale = getattr(module, "scale", None)
    if plan.scale is None and scale is not None:
        return dataclasses.replace(plan, scale=float(scale))
    return plan


def production_forward(
    module: nn.Module, plan: ContextParallelPlan, axis_mesh: DeviceMesh
) -> Callable[..., torch.Tensor]:
    """The production-mode forward of a context-parallel attention core (plain local
    tensors in and out)."""
    resolved = _scale(module, plan)
    axis = axis_mesh.mesh_dim_names[0]

    def forward(self: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q, k, v, axis_mesh, axis, resolved)

    return forward


def install_validation_forward(
    module: nn.Module, plan: ContextParallelPlan, mesh: DeviceMesh, axis: str
) -> None:
    """Validation mode: the core takes the DTensors its boundaries checked (``Shard(2)`` on
    ``axis``), runs the production computation on their local shards and wraps the result in
    the query's layout."""
    from hp_dtensor.dtensor import DTensor

    resolved = _scale(module, plan)

    def forward(self: nn.Module, q: Any, k: Any, v: Any) -> DTensor:
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, DTensor) or t.dist_layout != q.dist_layout:
                layout = t.dist_layout if isinstance(t, DTensor) else type(t).__name__
                raise ContextParallelError(
                    f"context-parallel attention needs query, key and value as DTensors of one "
                    f"layout; the {name} is {layout}"
                )
        out = context_parallel_attention(
            q.to_local(), k.to_local(), v.to_local(), mesh, axis, resolved
        )
        # Attention keeps q's layout by construction: no cross-rank check per forward.
        return DTensor.from_local(out, mesh, q.placements, shape=tuple(q.shape), run_check=False)

    object.__setattr__(module, "forward", types.MethodType(forward, module))
