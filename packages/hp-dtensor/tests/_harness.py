"""Check a sharding rule against the single-device op, for many input layouts at once.

``check_op`` runs on every rank (inside a rank pool): for each combination of input
placements it distributes the same random inputs, runs the op on DTensors, and compares the
whole outputs and the whole input gradients with the single-device op. Partial inputs get
random pieces that sum to the value. Every rank walks the same combinations in the same order.
"""

from __future__ import annotations

import itertools
import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from hp_dtensor import DeviceMesh, DTensor, ShardingRuleError, distribute_tensor
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard
from hp_layout.reference import scatter

Op = Callable[..., Any]


@dataclass
class CheckReport:
    """What ``check_op`` saw on one rank."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def placement_options(ndim: int, partial: bool = True) -> list[Placement]:
    """Replicate, Shard on every dim, and (optionally) Partial(sum)."""
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(ndim))]
    if partial:
        options.append(Partial(ReduceOp.SUM))
    return options


def _mesh(shape: Sequence[int]) -> DeviceMesh:
    names = ("a", "b", "c")[: len(shape)]
    return DeviceMesh("cpu", Mesh(tuple(shape), names))


def _distribute(
    value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], seed: int
) -> DTensor:
    if not any(isinstance(p, Partial) for p in placements):
        out = distribute_tensor(value, mesh, placements, src_data_rank=None)
        out.requires_grad_(value.requires_grad)
        return out
    layout = Layout(tuple(value.shape), mesh.mesh, placements)
    pieces = scatter(value.detach().numpy(), layout, rng=np.random.default_rng(seed))
    local = torch.from_numpy(np.ascontiguousarray(pieces[dist.get_rank()])).to(value.dtype)
    local.requires_grad_(value.requires_grad)
    return DTensor.from_local(local, mesh, placements, shape=tuple(value.shape))


def as_dtensor(x: object) -> DTensor:
    """``x`` typed as a DTensor (gradients and results of DTensor ops are DTensors)."""
    assert isinstance(x, DTensor), type(x)
    return x


def _full(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _compare(name: str, got: Any, want: Any, atol: float) -> str | None:
    flat_got, _ = tree_flatten(got)
    flat_want, _ = tree_flatten(want)
    if len(flat_got) != len(flat_want):
        return f"{name}: {len(flat_got)} outputs, single device gave {len(flat_want)}"
    for k, (g, w) in enumerate(zip(flat_got, flat_want, strict=True)):
        g = _full(g)
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                shape = getattr(g, "shape", None)
                return f"{name}[{k}]: shape {shape} vs single device {tuple(w.shape)}"
            if w.dtype.is_floating_point:
                if not torch.allclose(g.double(), w.double(), atol=atol, rtol=atol):
                    err = (g.double() - w.double()).abs().max().item()
                    return f"{name}[{k}]: max abs error {err:.3g} > {atol}"
            elif not torch.equal(g, w):
                return f"{name}[{k}]: values differ from single device"
        elif g != w:
            return f"{name}[{k}]: {g!r} vs single device {w!r}"
    return None


def _combinations(
    choices: Sequence[Sequence[Any]], limit: int | None, seed: int
) -> list[tuple[Any, ...]]:
    """Every combination of one choice per input, or a fixed random subset of ``limit``,
    drawn by index so the full product is never built."""
    sizes = [len(c) for c in choices]
    total = 1
    for n in sizes:
        total *= n
    indices = (
        range(total)
        if limit is None or total <= limit
        else sorted(random.Random(seed).sample(range(total), limit))
    )
    out = []
    for index in indices:
        combo = []
        for options, n in zip(reversed(choices), reversed(sizes), strict=True):
            index, pick = divmod(index, n)
            combo.append(options[pick])
        out.append(tuple(reversed(combo)))
    return out


def _any_rank(failed: bool) -> bool:
    """True if any rank failed: keeps the ranks in step after a local error."""
    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag)
    return bool(flag.item())


def check_op(
    op: Op,
    inputs: Sequence[torch.Tensor],
    mesh_shape: Sequence[int],
    *,
    options: Sequence[Sequence[Placement]] | None = None,
    max_combinations: int | None = None,
    backward: bool = True,
    atol: float = 1e-9,
    seed: int = 0,
) -> CheckReport:
    """Run ``op`` on DTensor versions of ``inputs`` for each placement combination.

    ``options[i]`` lists the placements tried for input ``i`` on every mesh axis (default:
    :func:`placement_options`). ``inputs`` that require grad get their gradients checked.
    With ``max_combinations``, a fixed random subset (the same on every rank) is tried.
    """
    mesh = _mesh(mesh_shape)
    per_input = [
        list(options[i]) if options is not None else placement_options(t.dim())
        for i, t in enumerate(inputs)
    ]
    per_input_mesh = [list(itertools.product(opts, repeat=len(mesh_shape))) for opts in per_input]
    combos = _combinations(per_input_mesh, max_combinations, seed)
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    want = op(*leaves)
    cotangents = [
        torch.randn(w.shape, dtype=w.dtype, generator=torch.Generator().manual_seed(seed + 7))
        if isinstance(w, torch.Tensor) and w.dtype.is_floating_point
        else None
        for w in tree_flatten(want)[0]
    ]
    want_grads: list[torch.Tensor | None] = []
    if backward and any(t.requires_grad for t in leaves):
        total = sum(
            (w * c).sum()
            for w, c in zip(tree_flatten(want)[0], cotangents, strict=True)
            if c is not None and w.requires_grad
        )
        assert isinstance(total, torch.Tensor)
        total.backward()
        want_grads = [t.grad for t in leaves]
    report = CheckReport()
    for n, combo in enumerate(combos):
        label = " ".join(f"in{i}={list(p)}" for i, p in enumerate(combo))
        error: str | None = None
        rejected = False
        try:
            dts = [
                _distribute(t, mesh, placements, seed + 101 * n + i)
                for i, (t, placements) in enumerate(zip(leaves, combo, strict=True))
            ]
            got = op(*dts)
        except ShardingRuleError as exc:
            rejected = True
            error = f"{label}: {exc}"
        except Exception:
            error = f"{label}: forward raised\n{traceback.format_exc()}"
        if _any_rank(error is not None):
            if error is None:
                report.failures.append(f"{label}: another rank failed in forward")
            elif rejected:
                report.rejected.append(error)
            else:
                report.failures.append(error)
            continue
        problem = _compare("forward", got, want, atol)
        if problem is None and want_grads:
            try:
                total_d: Any = None
                for g, c in zip(tree_flatten(got)[0], cotangents, strict=True):
                    if c is None or not isinstance(g, DTensor) or not g.requires_grad:
                        continue
                    cot = distribute_tensor(
                        c, mesh, [Replicate()] * len(mesh_shape), src_data_rank=None
                    )
                    term = (g * cot).sum()
                    total_d = term if total_d is None else total_d + term
                if total_d is not None:
                    total_d.backward()
                got_grads = [
                    d.grad if t.requires_grad else None for d, t in zip(dts, leaves, strict=True)
                ]
            except Exception:
                problem = f"backward raised\n{traceback.format_exc()}"
            # Compare (a collective: full_tensor) only when every rank got this far.
            if _any_rank(problem is not None):
                problem = problem or "another rank failed in backward"
            else:
                problem = _compare("grad", got_grads, want_grads, atol)
        if problem is None:
            report.accepted.append(label)
        else:
            report.failures.append(f"{label}: {problem}")
    return report
