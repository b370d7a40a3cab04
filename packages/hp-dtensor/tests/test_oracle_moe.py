"""The MoE building blocks against a per-token reference written here, apart from the package.

The reference routes each token in float64 with plain formulas (softmax as ``exp(l - max) /
sum``, sigmoid as ``1 / (1 + exp(-l))``), picks its experts by sorting ``score + bias`` in
Python, takes the *unbiased* scores of the picked experts as weights (renormalized and scaled
as asked), and runs each expert's SwiGLU on the token. The load-balance loss is
``E * sum_e f_e P_e`` with ``f_e`` the share of the ``T * k`` assignments expert ``e`` got and
``P_e`` its mean normalized score. Inputs are chosen where the code matters: an expert bias
that changes the selection of many tokens (asserted), a ``route_scale`` other than 1, sigmoid
scores with renormalization, an expert that gets no token.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_dtensor.parallel.moe_ops import (
    attach_aux_loss,
    combine,
    grouped_swiglu,
    load_balance_loss,
    route,
    sort_by_expert,
)
from hp_testing.moe import MoE, TopKRouter

DIM, HIDDEN, EXPERTS, TOP_K, SHARED, TOKENS = 6, 5, 6, 2, 4, 24


def _scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Per-token scores of ``[T, E]`` float64 logits, by hand."""
    if score_func == "softmax":
        e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
        return e / e.sum(dim=-1, keepdim=True)
    return 1.0 / (1.0 + torch.exp(-logits))


def _pick(scores: torch.Tensor, bias: torch.Tensor | None, k: int) -> list[list[int]]:
    """Each token's ``k`` experts with the largest ``score + bias`` (Python sort)."""
    picks = []
    for row in scores.detach().tolist():
        biased = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(row)]
        picks.append(sorted(range(len(row)), key=lambda e: -biased[e])[:k])
    return picks


def _reference(
    moe: MoE, x: torch.Tensor, probe: torch.Tensor
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor, dict[str, torch.Tensor]]:
    """(output, picks, aux loss, gradients of ``sum(out * probe) + aux``) in float64."""
    r = moe.router
    params = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    xd = x.detach().double().requires_grad_()
    tokens = xd.reshape(-1, DIM)
    logits = tokens @ params["router.weight"].t()
    scores = _scores(logits, r.score_func)
    picks = _pick(scores, r.expert_bias, r.top_k)
    rows = []
    for t, chosen in enumerate(picks):
        weights = torch.stack([scores[t, e] for e in chosen])
        if r.normalize:
            weights = weights / weights.sum()
        weights = weights * r.route_scale
        acc = torch.zeros(DIM, dtype=torch.float64)
        for w, e in zip(weights, chosen, strict=True):
            w1, w2, w3 = (params[f"experts.{n}"][e] for n in ("w1", "w2", "w3"))
            h = F.silu(w1 @ tokens[t]) * (w3 @ tokens[t])
            acc = acc + w * (w2 @ h)
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared is not None:
        s1, s2, s3 = (params[f"shared.{n}.weight"] for n in ("w1", "w2", "w3"))
        out = out + (F.silu(tokens @ s1.t()) * (tokens @ s3.t())) @ s2.t()
    n_tokens = tokens.shape[0]
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    for chosen in picks:
        for e in chosen:
            counts[e] += 1
    probs = scores / scores.sum(dim=-1, keepdim=True)
    f = counts / (n_tokens * r.top_k)
    p = probs.mean(dim=0)
    aux = moe.aux_loss_coef * EXPERTS * (f * p).sum()
    loss = (out.view_as(xd) * probe.double()).sum() + aux
    loss.backward()
    grads = {n: t.grad for n, t in params.items()}
    grads["x"] = xd.grad
    return out.detach().view_as(x), picks, aux.detach(), grads  # type: ignore[return-value]


def _moe(score_func: str, **options: Any) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        DIM,
        HIDDEN,
        EXPERTS,
        TOP_K,
        score_func=score_func,  # type: ignore[arg-type]
        use_expert_bias=True,
        shared_hidden=SHARED,
        aux_loss_coef=0.05,
        **options,
    )
    assert moe.router.expert_bias is not None
    # Large enough to move many tokens' choices; expert 4 never chosen.
    moe.router.expert_bias.copy_(torch.tensor([0.15, -0.1, 0.05, 0.0, -1e3, 0.1]))
    return moe


CASES = [
    ("softmax", {}),
    ("softmax", {"route_scale": 2.5}),
    ("softmax", {"normalize_weights": True, "route_scale": 0.5}),
    ("sigmoid", {}),  # renormalized by default
    ("sigmoid", {"normalize_weights": False, "route_scale": 1.5}),
]


@pytest.mark.parametrize(("score_func", "options"), CASES)
def test_moe_equals_a_per_token_reference(score_func: str, options: dict[str, Any]) -> None:
    moe = _moe(score_func, **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, TOKENS // 4, DIM, generator=g).requires_grad_()
    probe = torch.randn(4, TOKENS // 4, DIM, generator=g)
    want, picks, want_aux, want_grads = _reference(moe, x, probe)
    # The bias matters: it changes the selection of many tokens.
    logits = x.detach().double().reshape(-1, DIM) @ moe.router.weight.detach().double().t()
    unbiased = _pick(_scores(logits, score_func), None, TOP_K)
    changed = sum(set(a) != set(b) for a, b in zip(picks, unbiased, strict=True))
    assert changed >= TOKENS // 4, changed

    got = moe(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    routing = moe.router(x.detach().reshape(-1, DIM))
    assert [sorted(r) for r in routing.experts.tolist()] == [sorted(p) for p in picks]
    counts = [sum(e in p for p in picks) for e in range(EXPERTS)]
    assert moe.last_counts is not None
    assert moe.last_counts.tolist() == counts
    assert counts[4] == 0
    assert moe.last_aux_loss is not None
    torch.testing.assert_close(moe.last_aux_loss.double(), want_aux, rtol=1e-5, atol=1e-8)

    (got * probe).sum().backward()
    named = dict(moe.named_parameters())
    for name, want_grad in want_grads.items():
        have = x.grad if name == "x" else named[name].grad
        assert have is not None, name
        torch.testing.assert_close(have.double(), want_grad, rtol=1e-5, atol=1e-6, msg=name)
    # The expert without tokens gets a zero gradient, not None.
    assert torch.equal(moe.experts.w1.grad[4], torch.zeros(HIDDEN, DIM))  # type: ignore[index]


def test_route_selects_by_biased_scores_and_weighs_by_unbiased_ones() -> None:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(10, DIM, generator=g, dtype=torch.float64)
    weight = torch.randn(EXPERTS, DIM, generator=g, dtype=torch.float64)
    bias = torch.linspace(-0.3, 0.3, EXPERTS, dtype=torch.float64)
    for score_func in ("softmax", "sigmoid"):
        routing = route(tokens, weight, 3, score_func=score_func, expert_bias=bias)
        scores = _scores(tokens @ weight.t(), score_func)
        picks = _pick(scores, bias, 3)
        assert routing.experts.tolist() == picks  # descending by biased score
        want = torch.tensor(
            [[float(scores[t, e]) for e in p] for t, p in enumerate(picks)], dtype=torch.float64
        )
        torch.testing.assert_close(routing.weights, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(
            routing.scores, scores / scores.sum(-1, keepdim=True), rtol=1e-12, atol=0
        )
        assert routing.counts.tolist() == [sum(e in p for p in picks) for e in range(EXPERTS)]
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 6\]"):
        route(tokens, weight, 7)
    with pytest.raises(ValueError, match="score_func"):
        route(tokens, weight, 1, score_func="relu")  # type: ignore[arg-type]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(("normalize", "scale"), [(True, 1.0), (False, 2.5), (True, 0.5)])
def test_route_normalizes_and_scales_the_weights_as_asked(
    score_func: str, normalize: bool, scale: float
) -> None:
    g = torch.Generator().manual_seed(6)
    tokens = torch.randn(9, DIM, generator=g, dtype=torch.float64)
    weight = torch.randn(EXPERTS, DIM, generator=g, dtype=torch.float64)
    bias = torch.linspace(0.2, -0.2, EXPERTS, dtype=torch.float64)
    routing = route(
        tokens,
        weight,
        TOP_K,
        score_func=score_func,  # type: ignore[arg-type]
        expert_bias=bias,
        normalize=normalize,
        scale=scale,
    )
    scores = _scores(tokens @ weight.t(), score_func)
    picks = _pick(scores, bias, TOP_K)
    assert routing.experts.tolist() == picks
    for t, chosen in enumerate(picks):
        want = [float(scores[t, e]) for e in chosen]
        total = sum(want) if normalize else 1.0
        want = [w / total * scale for w in want]
        torch.testing.assert_close(
            routing.weights[t], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0
        )


def test_sort_and_combine_by_brute_force() -> None:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(7, 3, generator=g)
    experts = torch.tensor([[2, 0], [1, 2], [0, 3], [3, 1], [2, 1], [0, 2], [3, 0]])
    weights = torch.rand(7, 2, generator=g)
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    from hp_dtensor.parallel.moe_ops import Routing

    routing = Routing(experts, weights, torch.zeros(7, 4), counts)
    rows, order = sort_by_expert(tokens, routing)
    # Expert-major, token order within an expert.
    want_order = [
        t * 2 + j for e in range(4) for t in range(7) for j in range(2) if experts[t, j] == e
    ]
    assert order.tolist() == want_order
    assert torch.equal(rows, tokens[[a // 2 for a in want_order]])
    # Any per-row function; combine sums each token's k rows by its weights.
    out_rows = rows * 3.0 + torch.arange(rows.shape[0]).unsqueeze(-1)
    got = combine(out_rows, order, weights)
    want = torch.zeros(7, 3)
    for position, assignment in enumerate(want_order):
        t, j = divmod(assignment, 2)
        want[t] += weights[t, j] * out_rows[position]
    torch.testing.assert_close(got, want)


def test_grouped_swiglu_runs_each_expert_on_its_rows() -> None:
    g = torch.Generator().manual_seed(4)
    w1, w3 = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    w2 = torch.randn(3, 2, 4, generator=g)
    rows = torch.randn(5, 2, generator=g)
    counts = [2, 0, 3]
    got = grouped_swiglu(rows, counts, w1, w2, w3)
    owner = [0, 0, 2, 2, 2]
    for i, e in enumerate(owner):
        h = F.silu(w1[e] @ rows[i]) * (w3[e] @ rows[i])
        torch.testing.assert_close(got[i], w2[e] @ h)
    with pytest.raises(ValueError, match="2 counts summing to 5 for 3 experts"):
        grouped_swiglu(rows, [2, 3], w1, w2, w3)


def test_load_balance_loss_formula_and_its_additive_split() -> None:
    g = torch.Generator().manual_seed(5)
    scores = torch.rand(8, 4, generator=g, dtype=torch.float64)
    scores = scores / scores.sum(-1, keepdim=True)
    counts = torch.tensor([5, 1, 6, 4])  # 16 assignments of 8 tokens, k = 2
    want = 4 * torch.stack([(counts[e] / 16.0) * scores[:, e].mean() for e in range(4)]).sum()
    torch.testing.assert_close(load_balance_loss(scores, counts, 8, 2), want)
    # Disjoint token subsets (with the global counts) add up to the whole.
    halves = load_balance_loss(scores[:3], counts, 8, 2) + load_balance_loss(
        scores[3:], counts, 8, 2
    )
    torch.testing.assert_close(halves, want)
    assert float(load_balance_loss(scores[:0], counts, 0, 2)) == 0.0


def test_attach_aux_loss_adds_its_gradient() -> None:
    a = torch.tensor(2.0, requires_grad=True)
    out = torch.tensor([1.0, 3.0], requires_grad=True)
    aux = a * a
    y = attach_aux_loss(out, aux, 0.5)
    assert torch.equal(y, out)
    (y * torch.tensor([2.0, -1.0])).sum().backward()
    assert torch.equal(out.grad, torch.tensor([2.0, -1.0]))  # type: ignore[arg-type]
    assert float(a.grad) == 0.5 * 2 * 2.0  # type: ignore[arg-type]


def test_update_expert_bias_moves_towards_balance() -> None:
    router = TopKRouter(4, 4, 1, use_expert_bias=True)
    assert router.expert_bias is not None
    router.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.25, 0.0]))
    router.update_expert_bias(torch.tensor([7, 1, 2, 2]), rate=0.1)  # mean 3
    # Overloaded experts go down, underloaded ones up, by the rate (sign only).
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.4, 0.1, -0.15, 0.1]))
    router.update_expert_bias(torch.tensor([3, 3, 3, 3]), rate=0.1)  # balanced: unchanged
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.4, 0.1, -0.15, 0.1]))
    with pytest.raises(RuntimeError, match="no expert bias"):
        TopKRouter(4, 4, 1).update_expert_bias(torch.ones(4), rate=0.1)


def test_router_defaults_and_errors() -> None:
    assert TopKRouter(4, 4, 2, score_func="sigmoid").normalize
    assert not TopKRouter(4, 4, 2).normalize
    bound = 1.0 / math.sqrt(4)
    w = TopKRouter(4, 8, 2).weight.detach()
    assert float(w.abs().max()) <= bound
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        TopKRouter(4, 4, 5)
    with pytest.raises(ValueError, match="MoE expects 6 features"):
        _moe("softmax")(torch.randn(2, 5))
