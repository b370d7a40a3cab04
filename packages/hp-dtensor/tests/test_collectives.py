"""Autograd collectives of :mod:`hp_dtensor.collectives` against single-process math.

Every rank builds every group member's input from that member's rank (deterministic seeds),
so it computes the expected result of each collective locally. Inputs are integer-valued
float64 (sums are exact whatever order gloo adds in; MAX/MIN see many ties). The backward is
checked to be the true adjoint: for random cotangents ``c_j`` on each rank of a group,
``sum_j <f(x)_j, c_j> == sum_k <x_k, grad_k>`` (the dot products are summed over each group
on the host), and for MAX/MIN the gradient is checked to be split evenly among tied ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh, collectives
from hp_layout import Mesh, ReduceOp, chunk_sizes
from hp_testing import RankPool, run_on_ranks

OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)

CotangentOf = Callable[[int, torch.Size], torch.Tensor]
"""``cotangent_of(i, shape)``: the cotangent coordinate ``i`` of a group feeds backward."""

MESHES: dict[str, Mesh] = {
    "1d2": Mesh((2,), ("x",)),
    "1d4": Mesh((4,), ("x",)),
    "2d": Mesh((2, 2), ("a", "b")),
    "2d_permuted": Mesh((2, 2), ("a", "b"), (0, 3, 1, 2)),
}


@dataclass
class CollectiveReport:
    """What one rank saw: forward mismatches and each case's two adjoint dot products."""

    failures: list[str] = field(default_factory=list)
    dots: dict[str, tuple[float, float]] = field(default_factory=dict)
    cases: int = 0


def _integers(seed: int, *shape: int, low: int = -3, high: int = 4) -> torch.Tensor:
    """Integer-valued float64 data, the same on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(torch.float64)


def _cotangent(seed: int, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(shape, dtype=torch.float64, generator=g)


def _reduce(op: ReduceOp, parts: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.AVG:
        return stacked.mean(0)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    return stacked.amin(0)


class _Checker:
    """Runs the cases of one mesh axis on this rank and records the results."""

    def __init__(self, mesh: DeviceMesh, axis: str, label: str, report: CollectiveReport):
        self.mesh, self.axis, self.label, self.report = mesh, axis, label, report
        self.group = mesh.group_ranks(axis)
        self.index = mesh.get_local_rank(axis)
        self.rank = dist.get_rank()

    def run(
        self,
        name: str,
        make_input: Callable[[int], torch.Tensor],
        func: Callable[[torch.Tensor], torch.Tensor],
        expected: torch.Tensor,
        expected_grad: Callable[[CotangentOf], torch.Tensor] | None = None,
    ) -> None:
        """``make_input(i)`` is coordinate ``i``'s input; ``expected`` this rank's output.

        ``expected_grad(cotangent_of)`` is this rank's expected gradient, given the
        cotangent of each coordinate (``cotangent_of(i, shape)``), for ops whose gradient
        is checked directly.
        """
        case = f"{self.label}/{self.axis}/{name}"
        self.report.cases += 1
        x = make_input(self.index).requires_grad_()
        y = func(x)
        if y.shape != expected.shape or not torch.equal(y.detach(), expected):
            self.report.failures.append(
                f"rank {self.rank} {case}: forward {y.detach().tolist()} != {expected.tolist()}"
            )
        # Cotangents are seeded by coordinate so every member can rebuild the others'.
        seed = zlib.crc32(case.encode())

        def cotangent_of(i: int, shape: torch.Size) -> torch.Tensor:
            return _cotangent(seed + i, shape)

        cot = cotangent_of(self.index, y.shape)
        (grad,) = torch.autograd.grad(y, x, cot)
        self.report.dots[f"{case}@{self.rank}"] = (
            float((y.detach() * cot).sum()),
            float((x.detach() * grad).sum()),
        )
        if expected_grad is not None:
            want = expected_grad(cotangent_of)
            if not torch.allclose(grad, want, rtol=1e-12, atol=1e-12):
                self.report.failures.append(
                    f"rank {self.rank} {case}: grad {grad.tolist()} != {want.tolist()}"
                )


def _uneven(n: int) -> tuple[int, ...]:
    """Uneven extents, one empty: (3, 0), (3, 1, 0, 2), ..."""
    return (3, 1, 0, 2)[:n] if n > 2 else (3, 0)


def _check_gather_family(c: _Checker, base: int) -> None:
    n = len(c.group)
    for dim, sizes in ((0, (2,) * n), (0, _uneven(n)), (1, _uneven(n))):

        def make(i: int, dim: int = dim, sizes: tuple[int, ...] = sizes) -> torch.Tensor:
            shape = [4, 4]
            shape[dim] = sizes[i]
            return _integers(base + i, *shape)

        want = torch.cat([make(i) for i in range(n)], dim=dim)
        explicit = sizes if len(set(sizes)) > 1 else None  # default: every piece like ours
        gather = partial(collectives.all_gather, dim=dim, mesh=c.mesh, axis=c.axis, sizes=explicit)
        c.run(f"all_gather_d{dim}_{sizes}", make, gather, want)
    rs_cases: list[tuple[int, int, tuple[int, ...] | None]] = [(0, 7, None), (1, 6, _uneven(n))]
    for op in OPS:
        for dim, length, rs_sizes in rs_cases:
            pieces = rs_sizes if rs_sizes is not None else chunk_sizes(length, n)
            shape = (length, 3) if dim == 0 else (3, sum(pieces))

            def make_rs(i: int, shape: tuple[int, int] = shape) -> torch.Tensor:
                return _integers(base + 50 + i, *shape)

            full = _reduce(op, [make_rs(i) for i in range(n)])
            want = full.split(list(pieces), dim)[c.index]
            hit_grad = _extreme_grad_fn(op, make_rs, n, c.index, (dim, pieces))
            c.run(
                f"reduce_scatter_{op.value}_d{dim}_{rs_sizes}",
                make_rs,
                partial(
                    collectives.reduce_scatter,
                    dim=dim,
                    mesh=c.mesh,
                    axis=c.axis,
                    op=op,
                    sizes=rs_sizes,
                ),
                want,
                hit_grad,
            )


def _extreme_grad_fn(
    op: ReduceOp,
    make: Callable[[int], torch.Tensor],
    n: int,
    index: int,
    scatter: tuple[int, tuple[int, ...]] | None = None,
) -> Callable[[CotangentOf], torch.Tensor] | None:
    """This rank's expected gradient for a MAX/MIN reduction: split evenly between ties.

    The reduced value's cotangent is the sum of the group's cotangents (all-reduce), or the
    concatenation of the coordinates' cotangents along ``dim`` for a reduce-scatter with
    ``scatter=(dim, pieces)``.
    """
    if op not in (ReduceOp.MAX, ReduceOp.MIN):
        return None
    inputs = [make(i) for i in range(n)]
    result = _reduce(op, inputs)
    hits = [(x == result).to(torch.float64) for x in inputs]
    mine = hits[index] / sum(hits, torch.zeros_like(result))

    def grad(cotangent_of: CotangentOf) -> torch.Tensor:
        if scatter is None:
            total = sum((cotangent_of(i, result.shape) for i in range(n)), torch.zeros_like(result))
            return total * mine
        dim, pieces = scatter
        parts = [cotangent_of(i, p.shape) for i, p in enumerate(result.split(list(pieces), dim))]
        return torch.cat(parts, dim=dim) * mine

    return grad


def _check_reduce_family(c: _Checker, base: int) -> None:
    n = len(c.group)
    for op in OPS:

        def make(i: int) -> torch.Tensor:
            return _integers(base + 100 + i, 3, 4, low=-1, high=2)  # ties everywhere

        want = _reduce(op, [make(i) for i in range(n)])
        c.run(
            f"all_reduce_{op.value}",
            make,
            partial(collectives.all_reduce, mesh=c.mesh, axis=c.axis, op=op),
            want,
            _extreme_grad_fn(op, make, n, c.index),
        )
    for src in range(n):

        def make_b(i: int) -> torch.Tensor:
            return _integers(base + 200 + i, 2, 5)

        def grad_b(cotangent_of: CotangentOf, src: int = src) -> torch.Tensor:
            shape = make_b(0).shape
            total = sum(
                (cotangent_of(i, shape) for i in range(n)), torch.zeros(shape, dtype=torch.float64)
            )
            return total if c.index == src else torch.zeros_like(total)

        c.run(
            f"broadcast_from_{src}",
            make_b,
            partial(collectives.broadcast, mesh=c.mesh, axis=c.axis, src=src),
            make_b(src),
            grad_b,
        )


def _check_all_to_all(c: _Checker, base: int) -> None:
    n = len(c.group)
    cases = (
        (0, 1, 2 * n, None, (2,) * n),  # even, default sizes
        (0, 1, 5, chunk_sizes(5, n), _uneven(n)),  # uneven split and concat extents
        (1, 0, 7, chunk_sizes(7, n), _uneven(n)),
    )
    for split_dim, concat_dim, split_len, split_sizes, concat_sizes in cases:

        def make(
            i: int, sd: int = split_dim, sl: int = split_len, cs: tuple[int, ...] = concat_sizes
        ) -> torch.Tensor:
            shape = [0, 0]
            shape[sd] = sl
            shape[1 - sd] = cs[i]
            return _integers(base + 300 + i, *shape)

        pieces = split_sizes if split_sizes is not None else chunk_sizes(split_len, n)
        received = [make(i).split(list(pieces), split_dim)[c.index] for i in range(n)]
        want = torch.cat(received, dim=concat_dim)
        exchange = partial(
            collectives.all_to_all,
            split_dim=split_dim,
            concat_dim=concat_dim,
            mesh=c.mesh,
            axis=c.axis,
            split_sizes=split_sizes,  # None: the default split and this rank's extent
            concat_sizes=concat_sizes if split_sizes is not None else None,
        )
        c.run(f"all_to_all_{split_dim}{concat_dim}_{concat_sizes}", make, exchange, want)


def _body(mesh_names: list[str]) -> CollectiveReport:
    torch.set_num_threads(1)
    report = CollectiveReport()
    for label in mesh_names:
        mesh = DeviceMesh("cpu", MESHES[label])
        for k, axis in enumerate(mesh.mesh_dim_names):
            checker = _Checker(mesh, axis, label, report)
            base = 1000 * k
            _check_gather_family(checker, base)
            _check_reduce_family(checker, base)
            _check_all_to_all(checker, base)
    return report


def _assert_reports(reports: list[CollectiveReport], mesh_names: list[str]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, "\n".join(failures[:20])
    assert all(r.cases > 0 for r in reports)
    # Adjoint identity, summed over each group of each axis.
    dots: dict[str, tuple[float, float]] = {}
    for r in reports:
        dots.update(r.dots)
    checked = 0
    for label in mesh_names:
        mesh = MESHES[label]
        for axis in mesh.axis_names:
            cases = {key.split("@")[0] for key in dots if key.startswith(f"{label}/{axis}/")}
            for case in sorted(cases):
                for group in mesh.groups(axis):
                    lhs = sum(dots[f"{case}@{rank}"][0] for rank in group)
                    rhs = sum(dots[f"{case}@{rank}"][1] for rank in group)
                    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-10), (case, group)
                    checked += 1
    assert checked > 0


@pytest.mark.multiprocess
def test_collectives_world_2() -> None:
    names = ["1d2"]
    _assert_reports(run_on_ranks(2, _body, names, timeout=300), names)


@pytest.mark.multiprocess
def test_collectives_world_4_along_every_axis() -> None:
    names = ["1d4", "2d"]
    _assert_reports(run_on_ranks(4, _body, names, timeout=300), names)


@pytest.mark.multiprocess
def test_collectives_on_a_permuted_rank_grid() -> None:
    # A pool of its own: hp_dtensor creates axis groups lazily with
    # use_local_synchronization, whose group names include how many groups each rank has
    # created so far; after the default (2, 2) mesh's groups exist, this grid's groups would
    # be created by members with different counts and hang (see the report to the lead).
    names = ["2d_permuted"]
    with RankPool(4, timeout=300) as pool:
        _assert_reports(pool.run(_body, names), names)
