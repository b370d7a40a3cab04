"""Vocab-parallel cross-entropy: plain tensors (both gradient conventions), the production
``loss_parallel(mesh, axis)`` path and the DTensor (validation) path, against single-device
``F.cross_entropy`` in float64."""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _harness import as_dtensor
from hp_dtensor import DeviceMesh, DTensor, distribute_tensor
from hp_dtensor import _dispatch as dispatch_module
from hp_dtensor.parallel import loss as loss_module
from hp_dtensor.parallel.loss import (
    _loss_parallel_cross_entropy,
    loss_parallel,
    vocab_parallel_cross_entropy,
)
from hp_dtensor.rules.registry import OpCall, ShardingDecision, rule_for
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard, chunk_bounds
from hp_testing import run_on_ranks

ATOL = 1e-12
IGNORE = -100

# (logits shape, targets); class dim 1 (0 for 1-d logits). 7 classes split 4 + 3 over two
# ranks; 1 class gives an empty shard.
CASES: dict[str, tuple[tuple[int, ...], Any]] = {
    "2d": ((5, 7), [1, IGNORE, 6, 0, 3]),
    "3d": ((3, 7, 2), [[2, 6], [IGNORE, 0], [5, 3]]),
    "1d": ((7,), 5),
    "1d_ignored": ((7,), IGNORE),
    "one_class": ((4, 1), [0, IGNORE, 0, 0]),
}


def _data(name: str, ignore: int = IGNORE) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets of case ``name``; the ignored targets hold ``ignore``."""
    shape, target = CASES[name]
    g = torch.Generator().manual_seed(0)
    t = torch.tensor(target)
    t = torch.where(t == IGNORE, torch.full_like(t, ignore), t)
    return torch.randn(*shape, dtype=torch.float64, generator=g), t


def _class_dim(x: torch.Tensor) -> int:
    return 1 if x.dim() >= 2 else 0


def _piece(x: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``parts`` of the class dim (torch.chunk split, empty pieces too)."""
    dim = _class_dim(x)
    start, stop = chunk_bounds(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start)


def _reference(
    x: torch.Tensor, t: torch.Tensor, cot: torch.Tensor, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_()
    loss = F.cross_entropy(leaf, t, **options)
    (loss * cot).sum().backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(
        got, want, atol=ATOL, rtol=ATOL, equal_nan=True
    )


def _same_on_group(x: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """True when ``x`` is bit-identical on every rank of ``group`` (a collective)."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return all(torch.equal(p, pieces[0]) or (p.isnan().all() and x.isnan().all()) for p in pieces)


def _cotangent(loss_shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(loss_shape, dtype=torch.float64, generator=g)


# Plain tensors -----------------------------------------------------------------------------------


def _plain_cases(world: int) -> list[tuple[str, str, float, str, int, bool]]:
    names = ["2d", "3d", "1d", "1d_ignored", "one_class"] if world == 2 else ["2d", "3d"]
    return [
        (name, reduction, ls, convention, ignore, known)
        for name, reduction, ls, convention in itertools.product(
            names, ("none", "sum", "mean"), (0.0, 0.1), ("exact", "adjoint")
        )
        for ignore, known in ((IGNORE, False), (2, True))
    ]


def _run_plain_case(
    mesh: DeviceMesh,
    axis: str,
    case: tuple[str, str, float, str, int, bool],
    via_mode: bool,
    rows: slice = slice(None),
) -> str | None:
    """One case on this rank; ``rows`` picks this rank's batch rows (batch-sharded axis)."""
    name, reduction, ls, convention, ignore, known = case
    x, t = _data(name, ignore)
    if x.dim() >= 2:
        x, t = x[rows], t[rows]
    options: dict[str, Any] = {
        "reduction": reduction,
        "label_smoothing": ls,
        "ignore_index": ignore,
    }
    want_loss = F.cross_entropy(x, t, **options)
    cot = _cotangent(want_loss.shape)
    want, want_grad = _reference(x, t, cot, **options)
    size, index = mesh.size(axis), mesh.get_local_rank(axis)
    local = _piece(x, size, index).clone().requires_grad_()
    if via_mode:
        with loss_parallel(mesh, axis):
            loss = F.cross_entropy(local, t, **options)
    else:
        loss = vocab_parallel_cross_entropy(
            local,
            t,
            mesh=mesh,
            axis=axis,
            grad_convention=convention,  # type: ignore[arg-type]
            num_classes=x.shape[_class_dim(x)] if known else None,
            **options,
        )
    seed = cot if convention == "exact" or index == 0 else torch.zeros_like(cot)
    (loss * seed).sum().backward()
    label = f"{case} mode={via_mode}"
    if not _same_on_group(loss.detach(), mesh.get_group(axis)):
        return f"{label}: the loss differs between the ranks of the axis"
    if not _close(loss.detach(), want):
        return f"{label}: loss {loss.detach()} vs single device {want}"
    assert local.grad is not None
    if not _close(local.grad, _piece(want_grad, size, index)):
        err = (local.grad - _piece(want_grad, size, index)).abs().max().item()
        return f"{label}: logits grad differs by {err:.3g}"
    return None


def _plain_body(world: int) -> list[str]:
    torch.set_num_threads(1)
    failures: list[str] = []
    flat = DeviceMesh("cpu", Mesh((world,), ("tp",)))
    for case in _plain_cases(world):
        for via_mode in (False, True) if case[3] == "exact" else (False,):
            problem = _run_plain_case(flat, "tp", case, via_mode)
            if problem:
                failures.append(problem)
    if world == 4:
        # Vocab on "tp", batch on "dp": each dp row-block is its own single-device problem.
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
        dp = mesh.get_local_rank("dp")
        for case in _plain_cases(2)[::5]:
            for via_mode in (False, True) if case[3] == "exact" else (False,):
                rows = slice(None, 3) if dp == 0 else slice(3, None)
                problem = _run_plain_case(mesh, "tp", case, via_mode, rows)
                if problem:
                    failures.append(f"(2, 2) mesh: {problem}")
    return failures


def _expect_error(
    failures: list[str], what: str, error: type[Exception], match: str, fn: Callable[[], Any]
) -> None:
    try:
        fn()
    except error as exc:
        if match not in str(exc):
            failures.append(f"{what}: message {str(exc)!r} lacks {match!r}")
        return
    except Exception:
        failures.append(f"{what}: raised\n{traceback.format_exc()}")
        return
    failures.append(f"{what}: did not raise {error.__name__}")


def _errors_body() -> list[str]:
    """Bad input gives a clear error on every rank, before any collective of the loss."""
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    x, t = _data("2d")
    local = _piece(x, 2, dist.get_rank())
    failures: list[str] = []

    def plain_without_mesh() -> Any:
        with loss_parallel():
            return F.cross_entropy(local, t)

    def weighted() -> Any:
        with loss_parallel(mesh, "tp"):
            return F.cross_entropy(local, t, torch.ones(7, dtype=torch.float64))

    def vp(**kwargs: Any) -> Callable[[], Any]:
        args: dict[str, Any] = {"mesh": mesh, "axis": "tp", **kwargs}
        target = args.pop("target", t)
        return lambda: vocab_parallel_cross_entropy(local, target, **args)

    _expect_error(failures, "no mesh", ValueError, "needs the mesh", plain_without_mesh)
    _expect_error(failures, "weight", ValueError, "class weights", weighted)
    _expect_error(
        failures,
        "mesh only",
        ValueError,
        "both mesh and axis",
        lambda: loss_parallel(mesh).__enter__(),
    )
    _expect_error(
        failures,
        "bad axis",
        ValueError,
        "not an axis",
        lambda: loss_parallel(mesh, "x").__enter__(),
    )
    _expect_error(failures, "probabilities", ValueError, "class indices", vp(target=x.softmax(1)))
    _expect_error(failures, "target shape", ValueError, "does not fit", vp(target=t[:3]))
    _expect_error(failures, "reduction", ValueError, "reduction", vp(reduction="avg"))
    _expect_error(failures, "smoothing", ValueError, "label_smoothing", vp(label_smoothing=2.0))
    _expect_error(failures, "convention", ValueError, "grad_convention", vp(grad_convention="x"))
    _expect_error(failures, "num_classes", ValueError, "should hold", vp(num_classes=9))
    bad = t.clone()
    bad[0] = 7
    _expect_error(failures, "target range", RuntimeError, "outside [0, 7)", vp(target=bad))
    # nn.CrossEntropyLoss goes through F.cross_entropy, so it is vocab-parallel too.
    with loss_parallel(mesh, "tp"):
        module_loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(local, t)
    if not _close(module_loss, F.cross_entropy(x, t, label_smoothing=0.1)):
        failures.append(f"nn.CrossEntropyLoss under loss_parallel gave {module_loss}")
    # Other ops pass through the mode untouched; so does F.cross_entropy outside it.
    with loss_parallel(mesh, "tp"):
        if not torch.equal(torch.add(x, 1).softmax(1), (x + 1).softmax(1)):
            failures.append("ops other than cross_entropy changed inside loss_parallel")
    if not _close(F.cross_entropy(x, t), _reference(x, t, torch.tensor(1.0))[0]):
        failures.append("F.cross_entropy outside loss_parallel changed")
    return failures


# Where the numerics matter: logits that overflow, bf16 logits -----------------------------------


def _extreme_logits(offset: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[12, 11]`` logits around ``offset`` (rows spread by hundreds), targets with ignored
    rows; 11 classes split 6 + 5 over two ranks."""
    g = torch.Generator().manual_seed(3)
    rows = offset + 300.0 * torch.arange(12, dtype=torch.float64).unsqueeze(-1)
    x = (rows + 4.0 * torch.randn(12, 11, generator=g, dtype=torch.float64)).to(dtype)
    t = torch.randint(0, 11, (12,), generator=g)
    t[[2, 7]] = IGNORE
    return x, t


def _extreme_body() -> list[str]:
    """Large fp32 logits (exp overflows or underflows without the row maximum taken out) and
    bf16 logits (computed in fp32, one rounding at the end) against F.cross_entropy."""
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    index = mesh.get_local_rank("tp")
    failures: list[str] = []
    for offset, ls, reduction in itertools.product((1000.0, -3000.0), (0.0, 0.1), ("none", "mean")):
        x, t = _extreme_logits(offset, torch.float32)
        options: dict[str, Any] = {"reduction": reduction, "label_smoothing": ls}
        cot = _cotangent(F.cross_entropy(x, t, **options).shape)
        want, want_grad = _reference(x.double(), t, cot, **options)
        local = _piece(x, 2, index).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, t, mesh=mesh, axis="tp", **options)
        (loss * cot.float()).sum().backward()
        assert local.grad is not None
        label = f"fp32 offset={offset} ls={ls} {reduction}"
        # The logits themselves are exact in fp32; what is left is fp32 rounding of terms of
        # size ~10 (the spread within a row): well under 1e-5.
        err = (loss.double() - want).abs().max().item()
        grad_err = (local.grad.double() - _piece(want_grad, 2, index)).abs().max().item()
        if not err < 1e-5 or not grad_err < 1e-6:
            failures.append(f"{label}: loss error {err:.3g}, gradient error {grad_err:.3g}")
    for ls in (0.0, 0.1):
        # bf16 logits of a realistic spread; F.cross_entropy of their fp32 values, rounded to
        # bf16 once, is what "computed in float32" promises (loss and gradient).
        g = torch.Generator().manual_seed(4)
        x = (6.0 * torch.randn(64, 11, generator=g)).bfloat16()
        t = torch.randint(0, 11, (64,), generator=g)
        t[::9] = IGNORE
        cot = torch.randn(64, generator=g).bfloat16()
        ref = x.float().requires_grad_()
        ref_loss = F.cross_entropy(ref, t, reduction="none", label_smoothing=ls)
        (ref_loss * cot.float()).sum().backward()
        assert ref.grad is not None
        local = _piece(x, 2, index).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(
            local, t, mesh=mesh, axis="tp", reduction="none", label_smoothing=ls
        )
        (loss * cot).sum().backward()
        assert local.grad is not None
        if loss.dtype != torch.bfloat16 or local.grad.dtype != torch.bfloat16:
            failures.append(f"bf16 ls={ls}: loss {loss.dtype}, gradient {local.grad.dtype}")
            continue
        # Measured: every loss and gradient equals the fp32 result rounded once (0 differ;
        # computed in bf16 instead, 17-22 of 64 losses and over 100 gradients differ). A few
        # are allowed for another CPU's fp32 rounding tipping a value to its bf16 neighbour.
        loss_off = int((loss != ref_loss.bfloat16()).sum())
        grad_off = int((local.grad != _piece(ref.grad.bfloat16(), 2, index)).sum())
        if loss_off > 2 or grad_off > 6:
            failures.append(
                f"bf16 ls={ls}: {loss_off}/64 losses and {grad_off}/{local.grad.numel()} "
                "gradients differ from the fp32 result rounded once"
            )
    return failures


@pytest.mark.multiprocess
def test_overflowing_and_bf16_logits_world_2() -> None:
    _assert_clean(run_on_ranks(2, _extreme_body, timeout=120))


# DTensors (validation mode) --------------------------------------------------------------------


def _as_dtensor(
    value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], grad: bool
) -> DTensor:
    """``value`` distributed as ``placements``; a Partial axis splits it into equal pieces."""
    parts = 1
    for size, p in zip(mesh.shape, placements, strict=True):
        parts *= size if isinstance(p, Partial) else 1
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    whole = value / parts if parts > 1 else value
    local = distribute_tensor(whole, mesh, plain, src_data_rank=None).to_local().detach()
    return DTensor.from_local(
        local.clone().requires_grad_(grad), mesh, placements, shape=tuple(value.shape)
    )


def _dtensor_case(
    mesh: DeviceMesh,
    name: str,
    logits_p: Sequence[Placement],
    target_p: Sequence[Placement],
    options: dict[str, Any],
    want_loss_p: Sequence[Placement] | None,
    vocab_parallel: bool,
    inside: bool = True,
) -> str | None:
    x, t = _data(name, options.get("ignore_index", IGNORE))
    shape = F.cross_entropy(x, t, **options).shape
    cot = _cotangent(shape) if shape else torch.tensor(1.0, dtype=torch.float64)
    want, want_grad = _reference(x, t, cot, **options)
    xd = _as_dtensor(x, mesh, logits_p, True)
    td = _as_dtensor(t, mesh, target_p, False)
    label = f"{name} logits={list(logits_p)} target={list(target_p)} {options} inside={inside}"
    calls: list[int] = []
    apply = loss_module._apply

    def counting(
        logits: torch.Tensor, target: torch.Tensor, config: loss_module._Config
    ) -> torch.Tensor:
        calls.append(1)
        return apply(logits, target, config)

    loss_module._apply = counting
    try:
        if inside:
            with loss_parallel():
                loss = as_dtensor(F.cross_entropy(xd, td, **options))
        else:
            loss = as_dtensor(F.cross_entropy(xd, td, **options))
    finally:
        loss_module._apply = apply
    if bool(calls) != vocab_parallel:
        return f"{label}: vocab-parallel loss used: {bool(calls)}, expected {vocab_parallel}"
    if want_loss_p is not None and tuple(loss.placements) != tuple(want_loss_p):
        return f"{label}: loss placements {loss.placements}, expected {tuple(want_loss_p)}"
    if loss.dim() == 0:
        scalar: torch.Tensor = loss
        scalar.backward()  # DTensor's seed: 1 on coordinate 0 of Replicate axes, 0 elsewhere
    else:
        (loss * _as_dtensor(cot, mesh, [Replicate()] * mesh.ndim, False)).sum().backward()
    got = loss.full_tensor().detach()
    if not _close(got, want):
        return f"{label}: loss {got} vs single device {want}"
    grad = as_dtensor(xd.grad).full_tensor()
    if not _close(grad, want_grad):
        return f"{label}: logits grad differs by {(grad - want_grad).abs().max().item():.3g}"
    return None


def _dtensor_cases_1d() -> list[tuple[Any, ...]]:
    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    cases: list[tuple[Any, ...]] = []
    for reduction, ls in itertools.product(("none", "sum", "mean"), (0.0, 0.1)):
        options = {"reduction": reduction, "label_smoothing": ls}
        cases += [
            ("2d", [s1], [r], options, [r], True),
            ("2d", [s1], [s0], options, [r], True),  # target gathered along the vocab axis
            ("3d", [s1], [r], options, [r], True),
            ("1d", [s0], [r], options, [r], True),
            ("one_class", [s1], [r], options, [r], True),  # an empty vocab shard
        ]
    ignore2 = {"ignore_index": 2, "label_smoothing": 0.1}
    cases += [
        ("2d", [s1], [r], ignore2, [r], True),
        # The class dim is not sharded: plain cross_entropy decides.
        ("2d", [s0], [s0], {"label_smoothing": 0.1}, [Partial(ReduceOp.SUM)], False),
        ("2d", [Partial()], [r], {"reduction": "none"}, [r], False),
    ]
    return cases


def _dtensor_cases_2d() -> list[tuple[Any, ...]]:
    r, s0, s1, p = Replicate(), Shard(0), Shard(1), Partial(ReduceOp.SUM)
    cases: list[tuple[Any, ...]] = []
    for reduction in ("none", "sum", "mean"):
        options = {"reduction": reduction, "label_smoothing": 0.1}
        out_dp = s0 if reduction == "none" else p
        cases += [
            ("2d", [s0, s1], [s0, r], options, [out_dp, r], True),  # batch dp, vocab tp
            ("3d", [r, s1], [s0, s0], options, [out_dp, r], True),  # logits follow targets
            ("2d", [p, s1], [r, r], options, [r, r], True),  # Partial on dp is reduced
            ("2d", [s1, s1], [r, r], options, [r, r], False),  # two vocab axes: gathered
        ]
    return cases


def _dtensor_body(mesh_shape: tuple[int, ...]) -> list[str]:
    torch.set_num_threads(1)
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    cases = _dtensor_cases_1d() if len(mesh_shape) == 1 else _dtensor_cases_2d()
    failures: list[str] = []
    for name, logits_p, target_p, options, out_p, vp in cases:
        try:
            problem = _dtensor_case(mesh, name, logits_p, target_p, options, out_p, vp)
        except Exception:
            problem = f"{name} {logits_p} {target_p} {options}: raised\n{traceback.format_exc()}"
        if problem:
            failures.append(problem)
    # Both paths share the decision cache: each keeps its own decisions, in any order.
    for inside in (False, True, False):
        name, logits_p, target_p, options, out_p, _ = cases[0]
        problem = _dtensor_case(mesh, name, logits_p, target_p, options, out_p, inside, inside)
        if problem:
            failures.append(f"cache round trip: {problem}")
    funcs = {key[0] for key in dispatch_module._PREPARED}
    if _loss_parallel_cross_entropy not in funcs or F.cross_entropy not in funcs:
        failures.append("expected cached decisions for both cross_entropy paths")
    return failures


# Tests -----------------------------------------------------------------------------------------


def _assert_clean(results: list[list[str]]) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


@pytest.mark.multiprocess
def test_plain_tensors_match_single_device_world_2() -> None:
    _assert_clean(run_on_ranks(2, _plain_body, 2, timeout=300))


@pytest.mark.multiprocess
def test_plain_tensors_world_4_empty_shard_and_2d_mesh() -> None:
    _assert_clean(run_on_ranks(4, _plain_body, 4, timeout=300))


@pytest.mark.multiprocess
def test_bad_input_gives_clear_errors() -> None:
    _assert_clean(run_on_ranks(2, _errors_body, timeout=120))


@pytest.mark.multiprocess
def test_dtensors_under_loss_parallel_world_2() -> None:
    _assert_clean(run_on_ranks(2, _dtensor_body, (2,), timeout=300))


@pytest.mark.multiprocess
def test_dtensors_under_loss_parallel_2d_mesh() -> None:
    _assert_clean(run_on_ranks(4, _dtensor_body, (2, 2), timeout=300))


# Pure decisions --------------------------------------------------------------------------------

MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None
    return rule(OpCall(func, "cross_entropy", args, kwargs, 0))


def _layout(shape: Sequence[int], *placements: Placement) -> Layout:
    return Layout(tuple(shape), MESH2, placements)


def test_decision_keeps_the_vocab_shard_and_replicates_the_loss_on_its_axis() -> None:
    logits = _layout((5, 7), Shard(0), Shard(1))
    target = _layout((5,), Replicate(), Shard(0))
    mean = _decide(_loss_parallel_cross_entropy, logits, target)
    assert mean.inputs[0].placements == (Shard(0), Shard(1))
    assert mean.inputs[1].placements == (Shard(0), Replicate())
    assert mean.outputs.placements == (Partial(ReduceOp.SUM), Replicate())
    none = _decide(_loss_parallel_cross_entropy, logits, target, reduction="none")
    assert none.outputs.placements == (Shard(0), Replicate())
    assert none.outputs.global_shape == (5,)
    spatial = _decide(
        _loss_parallel_cross_entropy,
        _layout((3, 7, 4), Shard(2), Shard(1)),
        _layout((3, 4), Replicate(), Replicate()),
        reduction="sum",
    )
    assert spatial.inputs[0].placements == (Shard(2), Shard(1))
    assert spatial.inputs[1].placements == (Shard(1), Replicate())
    assert spatial.outputs.placements == (Partial(ReduceOp.SUM), Replicate())


def test_decision_falls_back_to_plain_cross_entropy_where_vocab_parallel_does_not_apply() -> None:
    target = _layout((5,), Replicate(), Replicate())
    for logits, extra in [
        (_layout((5, 7), Shard(0), Replicate()), {}),  # class dim not sharded
        (_layout((5, 7), Shard(1), Shard(1)), {}),  # sharded on two axes
        (_layout((5, 7), Replicate(), Shard(1)), {"weight": _layout((7,), *[Replicate()] * 2)}),
    ]:
        got = _decide(_loss_parallel_cross_entropy, logits, target, **extra)
        want = _decide(F.cross_entropy, logits, target, **extra)
        assert got.inputs == want.inputs
        assert got.outputs == want.outputs
    assert _decide(
        _loss_parallel_cross_entropy, _layout((5, 7), Replicate(), Shard(1)), target
    ).inputs[0].placements == (Replicate(), Shard(1))
