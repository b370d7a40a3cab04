"""RankPool, run_on_ranks and the rank helpers, on real gloo process groups (world 2 and 4).

The rank functions are module-level functions of this test module: the workers import it by
name, which works because they inherit the parent's sys.path.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from hp_testing import (
    RankFailure,
    RankPool,
    RankTimeout,
    assert_all_ranks_equal,
    rank,
    run_on_ranks,
    world_size,
)

pytestmark = pytest.mark.multiprocess

GetPool = Callable[[int], RankPool]
#: Timeout for runs that are meant to hang (keep the suite short on 2 cores).
HANG_TIMEOUT = 2.0


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def pool(request: pytest.FixtureRequest, rank_pool: GetPool) -> RankPool:
    world: int = request.param
    return rank_pool(world)


# ------------------------------------------------------------------------------------------
# rank functions (run in the workers)
# ------------------------------------------------------------------------------------------


def describe_rank() -> dict[str, object]:
    env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        "rank": rank(),
        "world_size": world_size(),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "env": {name: os.environ[name] for name in env},
    }


def sum_of_ranks() -> torch.Tensor:
    t = torch.tensor([float(rank() + 1)])
    dist.all_reduce(t)
    return t


def scaled(x: torch.Tensor, *, scale: float) -> torch.Tensor:
    return x * scale + rank()


def raise_on_rank_one() -> int:
    if rank() == 1:
        raise ValueError(f"boom on rank {rank()}")
    return rank()


def raise_on_rank_one_while_others_reduce() -> None:
    if rank() == 1:
        raise ValueError("rank 1 gives up before the all_reduce")
    dist.all_reduce(torch.ones(1))


def raise_everywhere_rank_zero_last() -> None:
    if rank() == 0:
        time.sleep(0.3)
    raise KeyError(f"key of rank {rank()}")


def only_rank_one_reduces() -> int:
    if rank() == 1:
        dist.all_reduce(torch.ones(1))  # nobody else joins: blocks until killed
    return rank()


def sleep_on_last_rank() -> int:
    if rank() == world_size() - 1:
        time.sleep(60)
    return rank()


def exit_on_rank_one() -> int:
    if rank() == 1:
        os._exit(3)
    return rank()


def leave_collective_pending() -> None:
    if rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never matched, never waited for


def same_everywhere() -> None:
    assert_all_ranks_equal(torch.arange(6.0).reshape(2, 3))
    assert_all_ranks_equal(torch.tensor([float("nan"), 1.0]))
    assert_all_ranks_equal(torch.tensor([True, False]))
    assert_all_ranks_equal(torch.tensor(3.5))
    assert_all_ranks_equal(torch.zeros(0, 3, dtype=torch.int32))
    assert_all_ranks_equal(torch.tensor([1.0]) + rank() * 1e-9, atol=1e-6)


def rank_one_differs() -> None:
    assert_all_ranks_equal(torch.tensor([0.0, float(rank() == 1)]), msg="weights after step")


def rank_one_differs_by_one_ulp() -> None:
    # The defaults (rtol=0, atol=0) are exact: the nearest float above 1.0 is not 1.0.
    x = torch.tensor([1.0])
    if rank() == 1:
        x = torch.nextafter(x, torch.tensor([2.0]))
    assert_all_ranks_equal(x)


def shapes_differ() -> None:
    assert_all_ranks_equal(torch.zeros([1] * (rank() % 2 + 1)))


def dtypes_differ() -> None:
    assert_all_ranks_equal(torch.zeros(2, dtype=torch.int64 if rank() == 2 else torch.float32))


def subgroup_differs() -> None:
    group = dist.new_group([1, 3])
    if rank() in (1, 3):
        assert_all_ranks_equal(torch.tensor([float(rank())]), group=group)


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------


def test_results_in_rank_order_and_environment(pool: RankPool) -> None:
    results = pool.run(describe_rank)
    assert [r["rank"] for r in results] == list(range(pool.world_size))
    assert {r["world_size"] for r in results} == {pool.world_size}
    assert [r["pid"] for r in results] == pool.pids
    assert {r["threads"] for r in results} == {1}
    assert {r["backend"] for r in results} == {"gloo"}
    for i, r in enumerate(results):
        assert r["env"] == {
            "RANK": str(i),
            "WORLD_SIZE": str(pool.world_size),
            "LOCAL_RANK": str(i),
            "LOCAL_WORLD_SIZE": str(pool.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(pool.port),
        }


def test_all_reduce_and_tensor_results(pool: RankPool) -> None:
    world = pool.world_size
    sums = pool.run(sum_of_ranks)
    assert all(torch.equal(s, torch.tensor([world * (world + 1) / 2])) for s in sums)
    out = pool.run(scaled, torch.ones(2), scale=3.0)
    assert [t.tolist() for t in out] == [[3.0 + r, 3.0 + r] for r in range(world)]


def test_pool_is_reused(pool: RankPool, rank_pool: GetPool) -> None:
    first = [r["pid"] for r in pool.run(describe_rank)]
    second = [r["pid"] for r in pool.run(describe_rank)]
    assert first == second == pool.pids
    assert rank_pool(pool.world_size) is pool
    assert [r["pid"] for r in run_on_ranks(pool.world_size, describe_rank)] == first


def test_failure_names_rank_and_traceback(pool: RankPool) -> None:
    pids = pool.pids
    with pytest.raises(RankFailure) as info:
        pool.run(raise_on_rank_one)
    message = str(info.value)
    assert info.value.ranks == (1,)
    assert "===== rank 1: ValueError: boom on rank 1 =====" in message
    assert "Traceback (most recent call last)" in message
    assert "in raise_on_rank_one" in message
    assert "test_pool.raise_on_rank_one failed on 1 of" in message
    # Every rank answered and passed the after-task barrier: the workers were kept ...
    assert pool.pids == pids
    # ... and the next run works.
    assert [r["rank"] for r in pool.run(describe_rank)] == list(range(pool.world_size))


def test_failure_while_others_wait_in_collective(rank_pool: GetPool) -> None:
    pool = rank_pool(2)
    pids = pool.pids
    with pytest.raises(RankFailure) as info:
        pool.run(raise_on_rank_one_while_others_reduce)
    assert info.value.ranks == (1,)
    assert info.value.unanswered == (0,)
    message = str(info.value)
    assert "ValueError: rank 1 gives up before the all_reduce" in message
    assert "rank(s) [0] had not answered" in message
    assert "restarted" in message
    assert pool.run(sum_of_ranks)[0].item() == 3.0
    assert pool.pids != pids


def test_first_failure_listed_first(rank_pool: GetPool) -> None:
    with pytest.raises(RankFailure) as info:
        rank_pool(2).run(raise_everywhere_rank_zero_last)
    assert info.value.ranks == (1, 0)
    message = str(info.value)
    assert "(first failure: rank 1)" in message
    assert message.index("KeyError: 'key of rank 1'") < message.index("KeyError: 'key of rank 0'")


@pytest.mark.parametrize(
    ("world", "fn", "stuck"),
    [(2, only_rank_one_reduces, 1), (4, sleep_on_last_rank, 3)],
    ids=["world2-collective", "world4-sleep"],
)
def test_hang_times_out_and_recovers(
    rank_pool: GetPool, world: int, fn: Callable[[], int], stuck: int
) -> None:
    pool = rank_pool(world)
    pool.run(describe_rank)  # the pool is up (it may still be restarting after a test above)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(fn, timeout=HANG_TIMEOUT)
    assert HANG_TIMEOUT <= time.monotonic() - start < HANG_TIMEOUT + 10
    assert info.value.ranks == (stuck,)
    message = str(info.value)
    assert f"did not finish within {HANG_TIMEOUT:g} s: rank(s) [{stuck}] of {world}" in message
    if hasattr(signal, "SIGUSR1"):  # the stuck rank's Python stack, taken before the kill
        assert f"in {fn.__name__}" in info.value.stacks[stuck]
        assert f"in {fn.__name__}" in message
    assert [r["rank"] for r in pool.run(describe_rank)] == list(range(world))


def test_dead_worker_reported_and_replaced(pool: RankPool) -> None:
    old = pool.pids
    with pytest.raises(RankFailure) as info:
        pool.run(exit_on_rank_one)
    assert info.value.ranks[0] == 1
    assert f"the worker process of rank 1 (pid {old[1]}) exited with code 3" in str(info.value)
    assert pool.run(sum_of_ranks)[0].item() == (pool.world_size * (pool.world_size + 1) / 2)
    assert set(pool.pids).isdisjoint(old)


def test_pending_collective_fails_the_barrier(rank_pool: GetPool) -> None:
    pool = rank_pool(2)
    with pytest.raises(RankFailure) as info:
        pool.run(leave_collective_pending, timeout=HANG_TIMEOUT)
    assert "the after-task barrier failed" in str(info.value)
    assert pool.run(sum_of_ranks)[0].item() == 3.0


def test_assert_all_ranks_equal(rank_pool: GetPool) -> None:
    pool = rank_pool(4)
    assert pool.run(same_everywhere) == [None] * 4
    with pytest.raises(RankFailure) as info:
        pool.run(rank_one_differs)
    assert sorted(info.value.ranks) == [0, 1, 2, 3]
    assert (
        "weights after step: tensor differs across ranks: rank(s) [1] differ from rank(s) [0, 2, 3]"
    ) in str(info.value)
    with pytest.raises(RankFailure) as info:
        pool.run(rank_one_differs_by_one_ulp)
    assert "tensor differs across ranks: rank(s) [1] differ from rank(s) [0, 2, 3]" in str(
        info.value
    )
    with pytest.raises(RankFailure) as info:
        pool.run(shapes_differ)
    assert (
        "tensor shape/dtype differs across ranks: rank(s) [0, 2]: shape [1] dtype torch.float32; "
        "rank(s) [1, 3]: shape [1, 1] dtype torch.float32"
    ) in str(info.value)
    with pytest.raises(RankFailure) as info:
        pool.run(dtypes_differ)
    assert "rank(s) [2]: shape [2] dtype torch.int64" in str(info.value)
    with pytest.raises(RankFailure) as info:
        pool.run(subgroup_differs)
    assert info.value.ranks in ((1, 3), (3, 1))
    assert "rank(s) [3] differ from rank(s) [1]" in str(info.value)


def test_unpicklable_function_is_rejected(rank_pool: GetPool) -> None:
    pool = rank_pool(2)
    pids = pool.pids
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 1)
    assert pool.pids == pids


def test_marker_added(request: pytest.FixtureRequest, rank_pool: GetPool) -> None:
    assert request.node.get_closest_marker("multiprocess") is not None


def test_own_pool_close_and_errors() -> None:
    with pytest.raises(ValueError, match="world_size"):
        RankPool(0)
    with pytest.raises(ValueError, match="timeout"):
        RankPool(2, timeout=-1)
    with RankPool(1, timeout=60) as own:
        assert own.run(sum_of_ranks, timeout=60)[0].item() == 1.0
        processes = list(own.pids)
    assert own.closed
    for pid in processes:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        own.run(describe_rank)
    own.close()  # idempotent


def test_start_failure_is_reported() -> None:
    with RankPool(1, backend="no-such-backend", timeout=30) as bad:
        with pytest.raises(RankFailure) as info:
            bad.run(describe_rank)
        assert info.value.ranks == (0,)
        assert "starting 1 no-such-backend rank process(es) failed on rank(s) [0]" in str(
            info.value
        )
        assert "Unknown backend type no-such-backend" in str(info.value)
