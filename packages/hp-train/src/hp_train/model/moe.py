"""The trainer's mixture-of-experts layers: router, grouped experts, shared experts, MoE block.

* :class:`TopKRouter` -- token-choice top-k routing: softmax or sigmoid scores, an optional
  expert bias that shifts the *selection* only (DeepSeek-V3 auxiliary-loss-free balancing; the
  combine weights are the unbiased scores), optional renormalization of the k weights.
* :class:`GroupedExperts` -- ``E`` SwiGLU experts stored as stacks: ``w1``, ``w3``
  ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``, run on rows grouped by expert.
* :class:`SharedExperts` -- a SwiGLU MLP every token goes through.
* :class:`MoE` -- router + grouped experts (+ shared experts) + auxiliary load-balance loss.

The computation is hp-dtensor's pure functions (:mod:`hp_dtensor.parallel.moe_ops`), the same
ones its expert-parallel dispatch composes around the token exchange, and :class:`MoE` has the
structure of :class:`hp_dtensor.parallel.ExpertModule`: ``ExpertParallel`` and
``ExpertTensorParallel`` shard it, and its sharded forward equals this single-device one.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from hp_dtensor.parallel.moe_ops import (
    Routing,
    ScoreFunc,
    attach_aux_loss,
    combine,
    grouped_swiglu,
    load_balance_loss,
    route,
    sort_by_expert,
    swiglu,
)

__all__ = ["GroupedExperts", "MoE", "SharedExperts", "TopKRouter"]


class TopKRouter(nn.Module):
    """Token-choice top-k gate: ``weight`` ``[E, dim]``; optional ``expert_bias`` buffer ``[E]``.

    Args:
        dim: token features.
        num_experts: ``E``.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        use_expert_bias: keep an ``expert_bias`` buffer added to the scores for the top-k
            selection only (update it with :meth:`update_expert_bias`).
        normalize_weights: divide the k weights by their sum (default: True for sigmoid).
        route_scale: factor on the combine weights.
    """

    expert_bias: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        use_expert_bias: bool = False,
        normalize_weights: bool | None = None,
        route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        self.top_k = top_k
        self.score_func: ScoreFunc = score_func
        self.normalize = score_func == "sigmoid" if normalize_weights is None else normalize_weights
        self.route_scale = route_scale
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts) if use_expert_bias else None, persistent=True
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``+-1/sqrt(dim)`` (as ``nn.Linear``)."""
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens`` ``[T, dim]`` (see :func:`route`)."""
        return route(
            tokens,
            self.weight,
            self.top_k,
            score_func=self.score_func,
            expert_bias=self.expert_bias,
            normalize=self.normalize,
            scale=self.route_scale,
        )

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3 balancing: ``bias += rate * sign(mean(counts) - counts)``.

        Pass the counts over *all* tokens of the step (``MoE.last_counts`` is that, also under
        expert parallelism), so every rank applies the same update.
        """
        if self.expert_bias is None:
            raise RuntimeError("this router has no expert bias (use_expert_bias=False)")
        bias = self.expert_bias
        local = cast(torch.Tensor, bias.to_local()) if hasattr(bias, "to_local") else bias
        load = counts.to(local.dtype)
        local.add_(rate * torch.sign(load.mean() - load))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as stacks ``w1``, ``w3`` ``[E, hidden, dim]``, ``w2``
    ``[E, dim, hidden]`` (each matrix ``[out, in]``, as ``nn.Linear``)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each matrix uniform in ``+-1/sqrt(in_features)`` (as ``nn.Linear``)."""
        for w in (self.w1, self.w2, self.w3):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    @property
    def num_experts(self) -> int:
        """The number of experts held here (local experts under expert parallelism)."""
        return int(self.w1.shape[0])

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert (``counts[e]`` for expert ``e``) through their experts."""
        return grouped_swiglu(rows, counts, self.w1, self.w2, self.w3)


class SharedExperts(nn.Module):
    """A SwiGLU MLP that every token goes through (``w1``, ``w3`` ``[hidden, dim]``, ``w2``
    ``[dim, hidden]``; several shared experts are one with their hidden sizes added)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``swiglu(x)``."""
        return swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight)


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts): ``[..., dim] -> [..., dim]``.

    Args:
        dim: token features.
        hidden: each routed expert's hidden size.
        num_experts: routed experts ``E``.
        top_k: experts per token.
        score_func, use_expert_bias, normalize_weights, route_scale: see :class:`TopKRouter`.
        shared_hidden: hidden size of the shared experts (0: none).
        aux_loss_coef: ``alpha`` of the auxiliary load-balance loss
            ``alpha * load_balance_loss`` (0: none). It enters training through the output's
            backward (:func:`attach_aux_loss`): the gradients are those of
            ``loss + alpha * aux``; ``last_aux_loss`` holds its value (detached).

    After each forward, ``last_counts`` holds the tokens per expert (over all tokens, also
    under expert parallelism) and ``last_aux_loss`` the auxiliary loss (this rank's additive
    term under expert parallelism; the terms of all ranks sum to the loss).

    ``aux_grad_seed`` (default 1) is the gradient the single-device forward seeds the
    auxiliary loss with. A MoE kept whole on every rank of a tensor-parallel axis whose
    gradients follow the adjoint convention (partial per rank, summed over the axis, as
    replicated parameters of this package's production plans) computes the same auxiliary
    loss on each of them: seed it with 1 on one rank of the axis and 0 on the others, so it
    counts once.

    ``aux_grad_scale`` (default 1) multiplies whatever seed the forward gives (this one's or
    an expert-parallel forward's): a pipeline's schedule scales each microbatch's loss by
    ``1 / microbatches``, and the auxiliary loss is scaled with it
    (``hp_train.parallel.expert.scale_aux_gradient``).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: ScoreFunc = "softmax",
        use_expert_bias: bool = False,
        normalize_weights: bool | None = None,
        route_scale: float = 1.0,
        shared_hidden: int = 0,
        aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.router = TopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            use_expert_bias=use_expert_bias,
            normalize_weights=normalize_weights,
            route_scale=route_scale,
        )
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared = SharedExperts(dim, shared_hidden) if shared_hidden > 0 else None
        self.last_counts: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.aux_grad_seed = 1.0
        self.aux_grad_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Single device: every token to its top-k experts, weighted sum, plus shared experts."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects {self.dim} features, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        routing = self.router(tokens)
        rows, order = sort_by_expert(tokens, routing)
        out = combine(self.experts(rows, routing.counts.tolist()), order, routing.weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.last_counts = routing.counts.detach()
        out = self.finish(
            out, routing.scores, routing.counts, tokens.shape[0], aux_grad=self.aux_grad_seed
        )
        return out.view_as(x)

    def finish(
        self,
        out: torch.Tensor,
        scores: torch.Tensor,
        counts: torch.Tensor,
        num_tokens: int,
        *,
        aux_grad: float = 1.0,
    ) -> torch.Tensor:
        """Attach the auxiliary loss (``counts``, ``num_tokens`` over all tokens; ``scores``
        this rank's rows; its gradient seed ``aux_grad``) to ``out`` and record it in
        ``last_aux_loss``."""
        if self.aux_loss_coef == 0.0:
            self.last_aux_loss = None
            return out
        aux = self.aux_loss_coef * load_balance_loss(scores, counts, num_tokens, self.top_k)
        self.last_aux_loss = aux.detach()
        return attach_aux_loss(out, aux, aux_grad * self.aux_grad_scale)
