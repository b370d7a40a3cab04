"""The computation of a mixture-of-experts layer as pure functions on plain tensors.

These are the pieces the expert-parallel dispatch (:mod:`hp_dtensor.parallel.expert`) composes
around its token exchange, and the pieces a model's MoE layer composes on one device
(``hp_train.model.moe``), so both compute exactly the same thing:

* :func:`route` -- token-choice top-k routing (softmax or sigmoid scores, an optional expert
  bias that shifts the *selection* only, optional renormalization and scale), giving a
  :class:`Routing`;
* :func:`sort_by_expert` / :func:`combine` -- token copies grouped by expert, and back;
* :func:`swiglu` / :func:`grouped_swiglu` -- the experts' SwiGLU, one expert or a stack;
* :func:`load_balance_loss` / :func:`attach_aux_loss` -- the auxiliary load-balance loss and
  how it enters training.

Order is deterministic: an expert sees its tokens in token order (a stable sort), so a token
set split over ranks in order and concatenated gives the same rows per expert. The layers
themselves (router, expert stacks, the MoE block) belong to the models; what a layer must
offer to be expert-parallel is :class:`hp_dtensor.parallel.ExpertModule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F

__all__ = [
    "Routing",
    "ScoreFunc",
    "attach_aux_loss",
    "combine",
    "grouped_swiglu",
    "load_balance_loss",
    "route",
    "sort_by_expert",
    "swiglu",
]

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class Routing:
    """The routing of ``T`` tokens to ``k`` of ``E`` experts each.

    Attributes:
        experts: ``[T, k]`` int64 expert ids (distinct per token).
        weights: ``[T, k]`` combine weights (differentiable through the router).
        scores: ``[T, E]`` router scores, normalized per token to sum 1 (softmax scores, or
            sigmoid scores divided by their sum): the ``P`` of the load-balance loss.
        counts: ``[E]`` int64: how many of the ``T * k`` assignments each expert got.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    counts: torch.Tensor


def route(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    *,
    score_func: ScoreFunc = "softmax",
    expert_bias: torch.Tensor | None = None,
    normalize: bool = False,
    scale: float = 1.0,
) -> Routing:
    """Route ``tokens`` ``[T, dim]`` with gate ``weight`` ``[E, dim]`` to ``top_k`` experts.

    The top-k is taken over ``scores + expert_bias`` (bias for selection only); the weights are
    the unbiased scores of the chosen experts, divided by their sum if ``normalize``, times
    ``scale``. Postcondition: row ``t`` of the result depends only on token ``t``.
    """
    num_experts = weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}"
        )
    logits = F.linear(tokens, weight)
    if score_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
        probs = scores
    elif score_func == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    select = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    experts = torch.topk(select, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    # Not bincount, whose output length depends on the largest id: a fixed length keeps the
    # routing traceable by torch.compile in one graph.
    chosen = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=chosen.device)
    counts = counts.scatter_add(0, chosen, torch.ones_like(chosen))
    return Routing(experts=experts, weights=weights, scores=probs, counts=counts)


def sort_by_expert(tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``T * k`` token copies grouped by expert (expert 0's first), in token order within an
    expert; and ``order``, the assignment (``t * k + j``) each row came from.

    Postcondition: ``rows[i] == tokens[order[i] // k]``; expert ``e``'s rows are the
    ``routing.counts[e]`` rows after those of experts ``< e``.
    """
    top_k = routing.experts.shape[-1]
    order = torch.argsort(routing.experts.reshape(-1), stable=True)
    return tokens.index_select(0, order // top_k), order


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo :func:`sort_by_expert` and sum each token's ``k`` expert outputs by its weights.

    ``rows`` ``[T * k, dim]`` in the sorted order; returns ``[T, dim]``:
    ``out[t] = sum_j weights[t, j] * rows[position of assignment t * k + j]``.
    """
    tokens, top_k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_assignment = rows.index_select(0, inverse).view(tokens, top_k, -1)
    return (per_assignment * weights.unsqueeze(-1).to(rows.dtype)).sum(dim=1)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """``(silu(x w1^T) * (x w3^T)) w2^T`` with ``w1``, ``w3`` ``[hidden, dim]``, ``w2``
    ``[dim, hidden]``."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def grouped_swiglu(
    rows: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """Expert ``e``'s SwiGLU (``w1[e]``, ``w2[e]``, ``w3[e]``) on its ``counts[e]`` rows.

    ``rows`` are grouped by expert in the order of the stacks; an expert with no rows
    contributes nothing (its weights still get a zero gradient). Returns rows of
    ``w2.shape[1]`` features, in the same order.
    """
    if len(counts) != w1.shape[0] or sum(counts) != rows.shape[0]:
        raise ValueError(
            f"grouped_swiglu: {len(counts)} counts summing to {sum(counts)} for {w1.shape[0]} "
            f"experts and {rows.shape[0]} rows"
        )
    pieces = rows.split(counts, dim=0)
    outs = [swiglu(piece, w1[e], w2[e], w3[e]) for e, piece in enumerate(pieces)]
    if not outs:
        return rows.new_zeros((0, w2.shape[1]))
    return torch.cat(outs, dim=0)


def load_balance_loss(
    scores: torch.Tensor, counts: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """Switch-style auxiliary loss ``E * sum_e f_e * P_e``, written so that it splits over
    token shards: ``f_e = counts[e] / (num_tokens * k)`` and
    ``P_e = scores[:, e].sum() / num_tokens``.

    ``counts`` and ``num_tokens`` are over *all* tokens (no gradient); ``scores`` may be a
    subset of the tokens' rows, giving that subset's additive term (the terms of disjoint
    subsets sum to the loss over their union).
    """
    num_experts = scores.shape[-1]
    if num_tokens == 0:
        return scores.sum() * 0.0
    f = counts.to(scores.dtype) / float(num_tokens * top_k)
    p = scores.sum(dim=0) / float(num_tokens)
    return num_experts * (f * p).sum()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also seeds ``aux`` with gradient ``aux_grad``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, aux_grad: float) -> torch.Tensor:
        ctx.aux_grad = aux_grad
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.aux_grad, dtype=grad.dtype, device=grad.device), None


def attach_aux_loss(out: torch.Tensor, aux: torch.Tensor, aux_grad: float = 1.0) -> torch.Tensor:
    """``out`` unchanged; whenever a gradient flows back through it, ``aux`` gets gradient
    ``aux_grad``: the effect of adding ``aux`` to the loss (as Megatron's aux-loss scaler)."""
    return cast(torch.Tensor, _AttachAuxLoss.apply(out, aux, aux_grad))  # type: ignore[no-untyped-call]
