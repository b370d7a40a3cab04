"""all_gather_matmul / matmul_reduce_scatter (the decomposed reference on gloo) at world 2 and
4, against a single-process matmul of the full tensors; fake-tensor shapes; errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import hp_kernels
from hp_testing import run_on_ranks

# fp32 on CPU: the gathered product is the same matmul on the same full tensor as the
# single-process one, so it is asserted bit-equal. The reduce-scatter sums the ranks' partial
# products in another order than the single full matmul, so it differs by rounding: measured
# (torch 2.13, x86 CPU, the same on every run) at most 1.9 (world 2) and 4.0 (world 4) units of
# 2**-24 * (|a| @ |b|) per element, the scale of fp32 summation error, asserted at 12 (3x the
# worst, for another CPU's summation order); and at most 9.5e-7 (world 2) and 4.8e-6 (world 4)
# absolutely on entries up to 15 and 21, where the absolute bound of 1e-5 stays.
RS_ULPS = 12
RS_ATOL = 1e-5


def _global(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _all_gather_body(gather_dim: int) -> dict[str, float]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _global(0, 4 * world, 3 * world, 16)  # every rank builds the same global tensors
    b = _global(1, 16, 24)
    shard = full.chunk(world, dim=gather_dim)[rank]
    got = hp_kernels.all_gather_matmul(shard, b, gather_dim)
    want = torch.matmul(full, b)
    assert torch.equal(got, want), float((got - want).abs().max())
    # 2-D, the TP sequence-parallel case: [tokens / world, k] @ [k, n].
    a2 = _global(2, 8 * world, 32)
    got2 = hp_kernels.all_gather_matmul(a2.chunk(world)[rank], _global(3, 32, 12))
    want2 = a2 @ _global(3, 32, 12)
    assert torch.equal(got2, want2), float((got2 - want2).abs().max())
    return {"max_err": float((got - want).abs().max())}


def _reduce_scatter_body(scatter_dim: int) -> dict[str, float]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    k = 8 * world
    a = _global(4, 2 * world, 4 * world, k)
    b = _global(5, k, 6 * world)
    # Row-parallel: rank r holds the k-slice r of a and of b; partial products sum to a @ b.
    a_r = a.chunk(world, dim=-1)[rank]
    b_r = b.chunk(world, dim=0)[rank]
    got = hp_kernels.matmul_reduce_scatter(a_r, b_r, scatter_dim)
    want = torch.matmul(a, b).chunk(world, dim=scatter_dim)[rank]
    assert got.shape == want.shape
    # Summation error scales with the sum of |products| of each output element.
    scale = torch.matmul(a.abs(), b.abs()).chunk(world, dim=scatter_dim)[rank].double()
    err = (got.double() - want.double()).abs()
    return {"ulps": float((err / (2**-24 * scale)).max()), "max_err": float(err.max())}


def _errors_body() -> list[str]:
    world = dist.get_world_size()
    messages = []
    calls: list[Callable[[], torch.Tensor]] = [
        lambda: hp_kernels.all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3), 1),
        lambda: hp_kernels.all_gather_matmul(torch.randn(4, 8), torch.randn(7, 3)),
        lambda: hp_kernels.matmul_reduce_scatter(torch.randn(world + 1, 8), torch.randn(8, 3)),
    ]
    for call in calls:
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _fake_body() -> list[list[int]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ag = hp_kernels.all_gather_matmul(torch.empty(3, 5, 8), torch.empty(8, 2), 1)
        rs = hp_kernels.matmul_reduce_scatter(torch.empty(4, 8), torch.empty(8, 6), 1)
    return [list(ag.shape), list(rs.shape)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_matmul_equals_full_matmul(world: int) -> None:
    for gather_dim in (0, 1, -2):
        reports = run_on_ranks(world, _all_gather_body, gather_dim, timeout=300)
        assert len(reports) == world


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_matmul_reduce_scatter_equals_full_matmul(world: int) -> None:
    for scatter_dim in (0, 1, 2, -1):
        reports = run_on_ranks(world, _reduce_scatter_body, scatter_dim, timeout=300)
        worst = max(r["ulps"] for r in reports)
        max_err = max(r["max_err"] for r in reports)
        print(
            f"world {world} scatter_dim {scatter_dim}: {worst:.2f} units of 2**-24 |a||b|, "
            f"max |error| {max_err:.2e}"
        )
        assert worst <= RS_ULPS, (scatter_dim, worst)
        assert max_err <= RS_ATOL, (scatter_dim, max_err)


@pytest.mark.multiprocess
def test_errors_and_fake_shapes() -> None:
    messages = run_on_ranks(2, _errors_body, timeout=300)[0]
    assert len(messages) == 3, messages
    assert "gather_dim is the contraction dim k" in messages[0]
    assert "a_shard (4, 8) @ b (7, 3)" in messages[1]
    assert "not divisible by the group size 2; pad it to a multiple of 2" in messages[2]
    assert run_on_ranks(2, _fake_body, timeout=300)[0] == [[3, 10, 2], [4, 3]]
