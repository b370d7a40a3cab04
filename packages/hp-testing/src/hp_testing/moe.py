"""A small mixture-of-experts test model, self-contained (standard library and torch only).

This is the MoE the lower packages' tests shard (hp-dtensor's expert-parallel tests, and any
test of hp-fsdp or hp-muon that wants one): they may not import the models of hp-train, and
hp-testing imports no hp package, so the layer lives here as a *test model*, kept to what the
tests exercise. The trainer's production layer is ``hp_train.model.moe``; both have the
structure ``hp_dtensor.parallel.ExpertModule`` names, so the expert-parallel styles shard
either. Being written apart from hp-dtensor's ``moe_ops`` (which the expert-parallel dispatch
runs), it is also an independent check of that dispatch: a sharded forward must reproduce
this module's single-device forward.

Semantics: token-choice top-k routing over ``softmax`` or ``sigmoid`` scores; an optional
expert bias shifts the *selection* only (the combine weights are the unbiased scores), the
``k`` weights are optionally renormalized and scaled; each expert is a SwiGLU
``w2(silu(w1 x) * w3 x)`` with stacks ``w1``, ``w3`` ``[E, hidden, dim]``, ``w2``
``[E, dim, hidden]``; optional shared experts see every token; the auxiliary load-balance loss
``alpha * E * sum_e f_e P_e`` enters training through the output's backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedExperts", "MoE", "Routing", "SharedExperts", "TopKRouter"]

ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class Routing:
    """``T`` tokens to ``k`` experts each: ids ``[T, k]``, combine weights ``[T, k]``,
    per-token normalized scores ``[T, E]`` and the assignments per expert ``[E]``."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    counts: torch.Tensor


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; its backward seeds ``aux`` with gradient ``aux_grad``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, aux_grad: float) -> torch.Tensor:
        ctx.aux_grad = aux_grad
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.aux_grad, dtype=grad.dtype, device=grad.device), None


class TopKRouter(nn.Module):
    """Top-k gate ``weight`` ``[E, dim]`` with an optional ``expert_bias`` buffer ``[E]``
    (normalization defaults to on for sigmoid scores)."""

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
        bias = torch.zeros(num_experts) if use_expert_bias else None
        self.register_buffer("expert_bias", bias, persistent=True)
        bound = 1.0 / math.sqrt(dim)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens`` ``[T, dim]``."""
        logits = F.linear(tokens, self.weight)
        if self.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        bias = self.expert_bias
        select = scores.detach() if bias is None else scores.detach() + bias
        experts = torch.topk(select, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        counts = torch.bincount(experts.reshape(-1), minlength=self.weight.shape[0])
        return Routing(experts, weights, probs, counts)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """``bias += rate * sign(mean(counts) - counts)`` (towards balance)."""
        if self.expert_bias is None:
            raise RuntimeError("this router has no expert bias (use_expert_bias=False)")
        bias = self.expert_bias
        local = cast(torch.Tensor, bias.to_local()) if hasattr(bias, "to_local") else bias
        load = counts.to(local.dtype)
        local.add_(rate * torch.sign(load.mean() - load))


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as stacks ``w1``, ``w3`` ``[E, hidden, dim]``, ``w2``
    ``[E, dim, hidden]`` (each uniform in ``+-1/sqrt(in_features)``)."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert (``counts[e]`` for expert ``e``) through their experts."""
        pieces = rows.split(counts, dim=0)
        outs = [_swiglu(p, self.w1[e], self.w2[e], self.w3[e]) for e, p in enumerate(pieces)]
        return torch.cat(outs, dim=0) if outs else rows.new_zeros((0, self.w2.shape[1]))


class SharedExperts(nn.Module):
    """A SwiGLU MLP of three bias-free ``nn.Linear`` that every token goes through."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight)


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts): ``[..., dim] -> [..., dim]``.

    ``aux_loss_coef`` > 0 adds the load-balance loss through the output's backward (seeded with
    ``aux_grad_seed``); after a forward ``last_counts`` holds the tokens per expert and
    ``last_aux_loss`` the auxiliary loss (detached).
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
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE expects {self.dim} features, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        routing = self.router(tokens)
        # Token copies grouped by expert, in token order within an expert (a stable sort).
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        rows = tokens.index_select(0, order // self.top_k)
        expert_out = self.experts(rows, routing.counts.tolist())
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_assignment = expert_out.index_select(0, inverse).view(tokens.shape[0], self.top_k, -1)
        out = (per_assignment * routing.weights.unsqueeze(-1).to(expert_out.dtype)).sum(dim=1)
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
        """Attach the auxiliary loss to ``out`` (``counts``, ``num_tokens`` over all tokens;
        ``scores`` this rank's rows) and record it in ``last_aux_loss``."""
        if self.aux_loss_coef == 0.0:
            self.last_aux_loss = None
            return out
        if num_tokens == 0:
            balance = scores.sum() * 0.0
        else:
            f = counts.to(scores.dtype) / float(num_tokens * self.top_k)
            p = scores.sum(dim=0) / float(num_tokens)
            balance = scores.shape[-1] * (f * p).sum()
        aux = self.aux_loss_coef * balance
        self.last_aux_loss = aux.detach()
        return cast(torch.Tensor, _AttachAuxLoss.apply(out, aux, aux_grad))  # type: ignore[no-untyped-call]
