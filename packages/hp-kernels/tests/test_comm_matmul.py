"""all_gather_matmul / matmul_reduce_scatter (the decomposed reference on gloo) at world 2 and
4, against a single-process matmul of the full tensors; fake-tensor shapes; errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import hp_kernels
from hp_testing import run_on_ranks

# fp32 on CPU: the gathered product is the same matmul as the single-process one (bit-equal
# in practice, checked with a rounding-level tolerance); the reduce-scatter sums the ranks'
# partial products in another order than the single full matmul, so it differs by rounding.
ATOL = 1e-5
RTOL = 1e-5


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
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # 2-D, the TP sequence-parallel case: [tokens / world, k] @ [k, n].
    a2 = _global(2, 8 * world, 32)
    got2 = hp_kernels.all_gather_matmul(a2.chunk(world)[rank], _global(3, 32, 12))
    torch.testing.assert_close(got2, a2 @ _global(3, 32, 12), atol=ATOL, rtol=RTOL)
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
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return {"max_err": float((got - want).abs().max())}


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
        assert all(r["max_err"] <= ATOL for r in reports)


@pytest.mark.multiprocess
def test_errors_and_fake_shapes() -> None:
    messages = run_on_ranks(2, _errors_body, timeout=300)[0]
    assert len(messages) == 3, messages
    assert "gather_dim is the contraction dim k" in messages[0]
    assert "a_shard (4, 8) @ b (7, 3)" in messages[1]
    assert "not divisible by the group size 2; pad it to a multiple of 2" in messages[2]
    assert run_on_ranks(2, _fake_body, timeout=300)[0] == [[3, 10, 2], [4, 3]]
