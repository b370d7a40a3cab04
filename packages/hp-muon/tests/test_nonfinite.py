"""A NaN or inf gradient: ``Muon.step`` refuses it on every rank before anything changes.

Oracles: the state before the step (clones taken here, compared with ``torch.equal``), the rule
"first parameter in order, lowest rank holding a bad piece" written out in the test, and
``torch.optim.Muon`` on whole matrices for the steps around a skipped or refused one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor

from _sharders import sharders
from hp_muon import Muon, NonFiniteGradientError
from hp_testing import run_on_ranks

LR = 0.02
BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
SHAPES = ((32, 16), (16, 48), (24, 24), (7, 5))
NAMES = ("layers.0.attn.wq.weight", "layers.0.mlp.w1.weight", "layers.0.attn.wo.weight", "head")


def _params(shapes: tuple[tuple[int, ...], ...], seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(shapes: tuple[tuple[int, ...], ...], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _bits(t: torch.Tensor | None) -> bytes:
    """The bytes of ``t`` (NaN equals itself here, unlike under ``torch.equal``)."""
    assert t is not None
    return bytes(t.detach().contiguous().view(torch.uint8).reshape(-1).tolist())


def _clones(opt: Muon, params: list[nn.Parameter]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(p.detach().clone(), opt.state[p]["momentum_buffer"].detach().clone()) for p in params]


def _unchanged(
    opt: Muon, params: list[nn.Parameter], before: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return all(
        torch.equal(p.detach(), value) and torch.equal(opt.state[p]["momentum_buffer"], buf)
        for p, (value, buf) in zip(params, before, strict=True)
    )


# One process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_refused_naming_the_parameter_before_any_change(value: str) -> None:
    ours, theirs = _params(SHAPES), _params(SHAPES)
    opt = Muon(list(zip(NAMES, ours, strict=True)), lr=LR, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=LR)
    for p, q, g in zip(ours, theirs, _grads(SHAPES, 0), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    before = _clones(opt, ours)
    grads = _grads(SHAPES, 1)
    for p, g in zip(ours, grads, strict=True):
        p.grad = g.clone()
    assert ours[1].grad is not None
    ours[1].grad[3, 7] = BAD[value]
    poisoned = [p.grad.clone() for p in ours if p.grad is not None]
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    error = info.value
    assert isinstance(error, ValueError)
    kind = "nan" if value == "nan" else "inf"
    assert (error.parameter, error.index, error.rank, error.value) == (NAMES[1], 1, 0, kind)
    assert error.local_parameters == (NAMES[1],)
    assert str(error) == (
        f"Muon.step: the gradient of '{NAMES[1]}' is non-finite ({kind}) on rank 0; no "
        "parameter was updated. Lower the learning rate, clip gradients, or pass "
        "nonfinite='skip' to skip such steps"
    )
    assert _unchanged(opt, ours, before)
    assert all(_bits(p.grad) == _bits(g) for p, g in zip(ours, poisoned, strict=True))
    # The refused step left the state whole: fixing the gradient, the run goes on as torch's.
    for p, q, g in zip(ours, theirs, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_first_bad_parameter_in_order_and_every_local_one() -> None:
    """Several bad gradients, of two dtypes, after a parameter without a gradient: the error
    names the first in parameter order and lists this rank's bad ones."""
    shapes = ((8, 8), (12, 8), (8, 12), (6, 6))
    params = _params(shapes)
    with torch.no_grad():
        params[3].data = params[3].data.bfloat16()  # a later dtype batch than "c"'s
    names = ("a", "b", "c", "d")
    opt = Muon(list(zip(names, params, strict=True)), lr=LR)
    for p, g in zip(params[1:], _grads(shapes[1:], 0), strict=True):
        p.grad = g.to(p.dtype)
    assert params[2].grad is not None
    assert params[3].grad is not None
    params[3].grad[0, 0] = math.nan
    params[2].grad[5, 5] = math.inf
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    assert (info.value.parameter, info.value.index, info.value.value) == ("c", 2, "inf")
    assert info.value.local_parameters == ("c", "d")
    assert "(non-finite on this rank: 'c', 'd')" in str(info.value)
    assert not opt.state  # no momentum buffer was created


def test_unnamed_parameters_are_named_by_group_and_position() -> None:
    params = _params(SHAPES)
    groups: list[dict[str, Any]] = [{"params": params[:3]}, {"params": params[3:], "lr": 0.1}]
    opt = Muon(groups, lr=LR)
    for p, g in zip(params, _grads(SHAPES, 0), strict=True):
        p.grad = g
    assert params[3].grad is not None
    params[3].grad[6, 4] = math.nan
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[1\]\[0\] \(shape 7x5\)"):
        opt.step()
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    assert (info.value.parameter, info.value.index) == ("param_groups[1][0] (shape 7x5)", 3)


def test_skip_changes_nothing_then_steps_like_torch() -> None:
    """``nonfinite="skip"``: the bad step is a no-op that warns and counts; the next finite
    step equals ``torch.optim.Muon``'s from the same state (torch never saw the bad step)."""
    ours, theirs, plain = _params(SHAPES), _params(SHAPES), _params(SHAPES)
    opt = Muon(
        list(zip(NAMES, ours, strict=True)), lr=LR, ns_dtype=torch.bfloat16, nonfinite="skip"
    )
    checked = Muon(plain, lr=LR, ns_dtype=torch.bfloat16)  # the default, "raise"
    ref = torch.optim.Muon(theirs, lr=LR)
    for step in range(3):
        grads = _grads(SHAPES, step)
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        if step == 1:
            assert ours[2].grad is not None
            ours[2].grad[0, 0] = math.inf
            ours[2].grad[1, 1] = math.nan
            before = _clones(opt, ours)
            poisoned = [p.grad for p in ours]
            bad = ours[2].grad.clone()
            with pytest.warns(RuntimeWarning, match=rf"'{NAMES[2]}' is non-finite \(nan\)"):
                opt.step()
            assert opt.skipped_steps == 1
            assert _unchanged(opt, ours, before)
            # The same gradient tensors, kept, with the same values.
            assert all(p.grad is g for p, g in zip(ours, poisoned, strict=True))
            assert _bits(ours[2].grad) == _bits(bad)
            assert opt.last_step_stats is not None
            assert opt.last_step_stats.orthogonalized == 0
            continue
        for q, r, g in zip(theirs, plain, grads, strict=True):
            q.grad, r.grad = g.clone(), g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        ref.step()
        checked.step()
        assert opt.skipped_steps == (1 if step > 1 else 0)
        for a, b, c in zip(ours, theirs, plain, strict=True):
            assert torch.equal(a, b)
            assert torch.equal(c, b)  # a finite step is the same with the check
    assert opt.last_step_stats is not None
    assert opt.last_step_stats.orthogonalized == len(SHAPES)


def test_huge_finite_gradients_step() -> None:
    """Finite gradients whose squares overflow fp32 are finite: no refusal, torch's step."""
    ours, theirs = _params(SHAPES), _params(SHAPES)
    opt = Muon(ours, lr=LR, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=LR)
    for p, q, g in zip(ours, theirs, _grads(SHAPES, 0), strict=True):
        p.grad, q.grad = g * 1e30, g * 1e30
    opt.step()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert all(bool(torch.isfinite(a).all()) for a in ours)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('raise', 'skip'\)"):
        Muon(_params(SHAPES), nonfinite="ignore")  # type: ignore[arg-type]


# Two ranks, sharded ---------------------------------------------------------------------------

# (1, 6): one row, so one rank holds an empty piece of it under Shard(0).
DIST_SHAPES = ((12, 8), (1, 6), (8, 20), (16, 8))
DIST_NAMES = ("w_in", "tiny", "w_mid", "w_out")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, TorchDTensor) else t


def _sharded(name: str, **kwargs: object) -> tuple[list[nn.Parameter], Muon, object]:
    sharder = next(s for s in sharders(dist.get_world_size()) if s.name == name)
    params = sharder.make(
        [
            torch.randn(s, generator=torch.Generator().manual_seed(i))
            for i, s in enumerate(DIST_SHAPES)
        ]
    )
    opt = Muon(
        list(zip(DIST_NAMES, params, strict=True)),
        lr=LR,
        fuse_shapes=False,
        ns_dtype=torch.bfloat16,
        **sharder.muon_kwargs(),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )
    return params, opt, sharder


def _set_grads(params: list[nn.Parameter], sharder: object, step: int) -> None:
    for p, full in zip(params, _grads(DIST_SHAPES, step), strict=True):
        p.grad = sharder.grad(p, full)  # type: ignore[attr-defined]


def _poison(params: list[nn.Parameter], plan: dict[int, list[tuple[int, str]]]) -> None:
    """Write the bad values ``plan`` gives this rank into the last element of its pieces."""
    for index, value in plan.get(dist.get_rank(), []):
        grad = params[index].grad
        assert grad is not None
        local = _local(grad)
        assert local.numel() > 0, (dist.get_rank(), index)
        local.view(-1)[-1] = BAD[value]


def _local_clones(opt: Muon, params: list[nn.Parameter]) -> list[tuple[torch.Tensor, ...]]:
    return [
        (_local(p.detach()).clone(), _local(opt.state[p]["momentum_buffer"]).clone())
        for p in params
    ]


def _refuse_case(name: str, plan: dict[int, list[tuple[int, str]]]) -> dict[str, object]:
    params, opt, sharder = _sharded(name)
    _set_grads(params, sharder, 0)
    opt.step()
    before = _local_clones(opt, params)
    _set_grads(params, sharder, 1)
    _poison(params, plan)
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    after = _local_clones(opt, params)
    unchanged = all(
        torch.equal(a, b)
        for pair, was in zip(after, before, strict=True)
        for a, b in zip(pair, was, strict=True)
    )
    error = info.value
    return {
        "parameter": error.parameter,
        "rank": error.rank,
        "value": error.value,
        "local": error.local_parameters,
        "message": str(error),
        "unchanged": unchanged,
    }


def _expected(plan: dict[int, list[tuple[int, str]]]) -> tuple[str, int, str]:
    """The rule: the first parameter in order, the lowest rank holding a bad piece of it, NaN
    where that rank's piece holds one."""
    index = min(i for entries in plan.values() for i, _ in entries)
    rank = min(r for r, entries in plan.items() if any(i == index for i, _ in entries))
    values = {v for i, v in plan[rank] if i == index}
    return DIST_NAMES[index], rank, "nan" if "nan" in values else "inf"


# Rank -> (parameter, value) written into its pieces. Both sharders give each rank a piece of
# these: rank 0 of "tiny" and "w_mid", rank 1 of "w_mid" and "w_out".
PLANS = {
    "nan-on-rank-1-only": {1: [(3, "nan")]},
    "inf-on-rank-1-only": {1: [(2, "inf")]},
    "first-in-order-wins": {0: [(1, "-inf")], 1: [(2, "nan"), (3, "nan")]},
    "lowest-rank-wins": {0: [(2, "inf")], 1: [(2, "nan")]},
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["torch_fsdp2", "hp_fsdp_flat"])
@pytest.mark.parametrize("case", list(PLANS))
def test_every_rank_refuses_the_same_parameter(name: str, case: str) -> None:
    plan = PLANS[case]
    results = run_on_ranks(2, _refuse_case, name, plan, timeout=120)
    parameter, rank, value = _expected(plan)
    for r, got in enumerate(results):
        assert (got["parameter"], got["rank"], got["value"]) == (parameter, rank, value), r
        assert got["unchanged"], r
        mine = sorted({i for i, _ in plan.get(r, [])})
        assert got["local"] == tuple(DIST_NAMES[i] for i in mine), r
        assert f"'{parameter}' is non-finite ({value}) on rank {rank}" in str(got["message"])


def _skip_case(name: str) -> tuple[int, bool, list[str], bool]:
    params, opt, sharder = _sharded(name, nonfinite="skip")
    reference = [
        nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
        for i, s in enumerate(DIST_SHAPES)
    ]
    ref = torch.optim.Muon(reference, lr=LR)
    unchanged = True
    warned: list[str] = []
    for step in range(3):
        _set_grads(params, sharder, step)
        if step == 1:
            _poison(params, {1: [(3, "nan")]})
            before = _local_clones(opt, params)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            after = _local_clones(opt, params)
            unchanged = all(
                torch.equal(a, b)
                for pair, was in zip(after, before, strict=True)
                for a, b in zip(pair, was, strict=True)
            )
            continue
        for q, full in zip(reference, _grads(DIST_SHAPES, step), strict=True):
            q.grad = full
        opt.step()
        ref.step()
    equal = all(
        torch.equal(sharder.full(p), q.detach())  # type: ignore[attr-defined]
        for p, q in zip(params, reference, strict=True)
    )
    return opt.skipped_steps, unchanged, warned, equal


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["torch_fsdp2", "hp_fsdp_flat"])
def test_skip_is_a_no_op_on_every_rank_then_steps_like_torch(name: str) -> None:
    for r, (skipped, unchanged, warned, equal) in enumerate(
        run_on_ranks(2, _skip_case, name, timeout=120)
    ):
        assert skipped == 1, r
        assert unchanged, r
        assert len(warned) == 1, r
        assert "'w_out' is non-finite (nan) on rank 1" in warned[0], r
        assert equal, r  # steps 0 and 2 (finite) equal torch's on whole matrices, bit for bit
