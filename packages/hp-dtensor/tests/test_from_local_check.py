"""``DTensor.from_local(..., run_check=True)``: ranks that describe different tensors are
refused on every rank, with one collective, instead of building DTensors that later abort a
collective (a trailing-dim mismatch under ``Shard(0)`` used to kill a rank with gloo's
SIGABRT in the first gather) or silently disagree (``Replicate``).

Every expected message is written here from the tensors the test builds; the agreeing cases
compare ``full_tensor()`` with ``torch.cat`` of the same locals and with torch's own
``DTensor.from_local(run_check=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.debug import CommDebugMode

from hp_dtensor import DeviceMesh, DTensor, watchdog
from hp_layout import Mesh, Placement, Replicate, Shard
from hp_testing import run_on_ranks

# Every c10d entry point a collective of from_local could take (the watched path calls
# all_gather_single; the old extents gather goes through hp_dtensor's collectives, which
# call it too).
_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast",
)


def _line() -> DeviceMesh:
    return DeviceMesh("cpu", Mesh((2,), ("tp",)))


@contextmanager
def _counting() -> Iterator[list[str]]:
    """Record every c10d collective called (by name) while inside."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _outcome(fn: Callable[[], object]) -> str:
    """``ok`` or the ValueError's message (any other error propagates)."""
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "ok"


def _disagreement(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = _line()
    placements: list[Placement] = [Shard(0)]
    if kind == "trailing":
        local = torch.ones(4, 8 if rank == 0 else 6)
    elif kind == "dtype":
        local = torch.ones(4, 8, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    elif kind == "replicate":
        local, placements = torch.ones(4, 8 if rank == 0 else 6), [Replicate()]
    elif kind == "ndim":
        local = torch.ones(4, 8) if rank == 0 else torch.ones(4, 8, 1)
    elif kind == "requires_grad":
        local = torch.ones(4, 8, requires_grad=rank == 0)
    elif kind == "uneven_order":
        # 7 rows split by torch.chunk are 4 then 3; these ranks hold 3 then 4.
        local = torch.ones(3 if rank == 0 else 4, 8)
    elif kind == "shape_arg":
        local = torch.ones(4, 8)
        shape = (8, 8) if rank == 0 else (8, 9)
        return {
            "pid": os.getpid(),
            "message": _outcome(lambda: DTensor.from_local(local, mesh, placements, shape=shape)),
        }
    elif kind == "too_many_dims":
        local = torch.ones([2] + [1] * 16)
    else:
        raise AssertionError(kind)
    return {
        "pid": os.getpid(),
        "message": _outcome(lambda: DTensor.from_local(local, mesh, placements)),
    }


def _agreeing() -> dict[str, Any]:
    """An uneven Shard(0) (4 + 3 rows) and a Replicate tensor, built the checked way."""
    rank = dist.get_rank()
    mesh = _line()
    pieces = [torch.arange(32.0).reshape(4, 8), torch.arange(100.0, 124.0).reshape(3, 8)]
    sharded = DTensor.from_local(pieces[rank].clone(), mesh, [Shard(0)])
    replica = torch.arange(6.0).reshape(2, 3)
    replicated = DTensor.from_local(replica.clone(), mesh, [Replicate()])
    return {
        "pid": os.getpid(),
        "shape": tuple(sharded.shape),
        "full_ok": torch.equal(sharded.full_tensor(), torch.cat(pieces)),
        "replicated_ok": torch.equal(replicated.full_tensor(), replica),
        "replicated_shape": tuple(replicated.shape),
    }


def _same_as_torch() -> bool:
    """Even shards and a replica: ours and torch's run_check=True give the same full tensor."""
    rank = dist.get_rank()
    mesh = _line()
    torch_mesh = mesh.to_torch()
    local = torch.arange(24.0).reshape(3, 8) + 100 * rank
    ours = DTensor.from_local(local.clone(), mesh, [Shard(0)]).full_tensor()
    theirs = TorchDTensor.from_local(
        local.clone(), torch_mesh, [TorchShard(0)], run_check=True
    ).full_tensor()
    replica = torch.arange(6.0).reshape(2, 3)
    ours_r = DTensor.from_local(replica.clone(), mesh, [Replicate()]).full_tensor()
    theirs_r = TorchDTensor.from_local(
        replica.clone(), torch_mesh, [TorchReplicate()], run_check=True
    ).full_tensor()
    return torch.equal(ours, theirs) and torch.equal(ours_r, theirs_r)


def _collective_counts() -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = _line()
    local = torch.ones(4 if rank == 0 else 3, 8)
    out: dict[str, Any] = {}
    with _counting() as calls:
        DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 8), run_check=False)
    out["given_unchecked"] = list(calls)
    with _counting() as calls:
        DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 8))
    out["given_checked"] = list(calls)
    with _counting() as calls:
        DTensor.from_local(local, mesh, [Shard(0)])
    out["inferred_checked"] = list(calls)
    with _counting() as calls:
        unchecked = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    out["inferred_unchecked"] = list(calls)
    out["inferred_unchecked_shape"] = tuple(unchecked.shape)
    with _counting() as calls:
        DTensor.from_local(torch.ones(2, 3), mesh, [Replicate()])
    out["replicate_checked"] = list(calls)
    # Under torch's CommDebugMode the check runs as a functional collective: one, counted.
    mode = CommDebugMode()
    with mode:
        DTensor.from_local(local, mesh, [Shard(0)])
    out["comm_mode_checked"] = mode.get_total_counts()
    mode = CommDebugMode()
    with mode:
        DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 8), run_check=False)
    out["comm_mode_unchecked"] = mode.get_total_counts()
    return out


def _watched() -> list[str]:
    """The names of the watched collectives from_local enters."""
    seen: list[str] = []
    watchdog.configure(60.0)
    watchdog.set_entry_hook(lambda collective, group, number: seen.append(collective))
    try:
        DTensor.from_local(torch.ones(2, 3), _line(), [Shard(0)])
    finally:
        watchdog.set_entry_hook(None)
        watchdog.configure(None)
    return seen


def _unchecked_trailing() -> tuple[int, ...]:
    """run_check=False without shape: the gather completes, each rank keeps its own view."""
    rank = dist.get_rank()
    local = torch.ones(4, 8 if rank == 0 else 6)
    return tuple(DTensor.from_local(local, _line(), [Shard(0)], run_check=False).shape)


_EXPECTED = {
    "trailing": "DTensor.from_local: the ranks disagree on dim 1, which no mesh axis shards: "
    "rank 0 has 8, rank 1 has 6",
    "dtype": "DTensor.from_local: the ranks' local tensors differ in dtype: rank 0 has float32, "
    "rank 1 has bfloat16",
    "replicate": "DTensor.from_local: the ranks disagree on dim 1, which no mesh axis shards: "
    "rank 0 has 8, rank 1 has 6",
    "ndim": "DTensor.from_local: the ranks' local tensors differ in ndim: rank 0 has 2, "
    "rank 1 has 3",
    "requires_grad": "DTensor.from_local: the ranks' local tensors differ in requires_grad: "
    "rank 0 has True, rank 1 has False",
    "uneven_order": "DTensor.from_local: the local tensor of ranks 0-1 does not fit "
    "Layout([7, 8], {tp: Shard(0)}): rank 0 has (3, 8) where the layout gives it (4, 8), "
    "rank 1 has (4, 8) where the layout gives it (3, 8)",
    "shape_arg": "DTensor.from_local: the ranks pass different shape=: rank 0 has (8, 8), "
    "rank 1 has (8, 9)",
    "too_many_dims": "DTensor.from_local: run_check compares up to 16 dims, but ranks 0-1 have "
    "17 (local tensor or shape=); pass shape= and run_check=False for such a tensor",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", sorted(_EXPECTED))
def test_disagreeing_ranks_get_the_same_error_and_the_pool_survives(kind: str) -> None:
    before = run_on_ranks(2, _agreeing)
    results = run_on_ranks(2, _disagreement, kind)
    after = run_on_ranks(2, _agreeing)
    # Every rank raises, with the same message (one verdict from the same gathered rows).
    assert [r["message"] for r in results] == [_EXPECTED[kind]] * 2
    # No rank died or was restarted: the same processes ran all three tasks.
    pids = [r["pid"] for r in before]
    assert [r["pid"] for r in results] == pids
    assert [r["pid"] for r in after] == pids


@pytest.mark.multiprocess
def test_agreeing_ranks_build_the_same_dtensor_as_before() -> None:
    for result in run_on_ranks(2, _agreeing):
        assert result["shape"] == (7, 8)
        assert result["full_ok"]
        assert result["replicated_ok"]
        assert result["replicated_shape"] == (2, 3)


@pytest.mark.multiprocess
def test_full_tensor_equals_torchs_checked_from_local() -> None:
    assert run_on_ranks(2, _same_as_torch) == [True, True]


@pytest.mark.multiprocess
def test_one_collective_when_checked_none_when_unchecked_with_shape() -> None:
    for result in run_on_ranks(2, _collective_counts):
        assert result["given_unchecked"] == []
        assert result["given_checked"] == ["all_gather_single"]
        assert result["inferred_checked"] == ["all_gather_single"]
        # Without shape the extents are gathered anyway (one axis shards: one gather).
        assert result["inferred_unchecked"] == ["all_gather_single"]
        assert result["inferred_unchecked_shape"] == (7, 8)
        assert result["replicate_checked"] == ["all_gather_single"]
        assert result["comm_mode_checked"] == 1
        assert result["comm_mode_unchecked"] == 0


@pytest.mark.multiprocess
def test_the_check_runs_under_the_watchdog() -> None:
    assert run_on_ranks(2, _watched) == [["from_local check"], ["from_local check"]]


@pytest.mark.multiprocess
def test_unchecked_without_shape_completes_with_each_ranks_view() -> None:
    # Documented: run_check=False leaves agreement to the caller; the gather still completes.
    assert run_on_ranks(2, _unchecked_trailing) == [(8, 8), (8, 6)]


# World 4: two sharding axes, sub-grids, replicas along an axis -------------------------------


def _grid() -> DeviceMesh:
    # A permuted rank grid: coordinates are not rank order.
    return DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp"), (0, 2, 1, 3)))


def _at(mesh: DeviceMesh) -> tuple[int, int]:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    return coordinate[0], coordinate[1]


def _grid_cases() -> dict[str, Any]:
    mesh = _grid()
    dp, tp = _at(mesh)
    full = torch.arange(7.0 * 5).reshape(7, 5)
    # Shard(0) over dp, Shard(1) over tp: torch.chunk pieces (rows 4 + 3, cols 3 + 2).
    rows = full.chunk(2, 0)[dp]
    piece = rows.chunk(2, 1)[tp].clone()
    out: dict[str, Any] = {}
    with _counting() as calls:
        built = DTensor.from_local(piece, mesh, [Shard(0), Shard(1)])
    out["calls"] = list(calls)
    out["shape"] = tuple(built.shape)
    out["full_ok"] = torch.equal(built.full_tensor(), full)
    # Replicated over dp, sharded over tp; the dp replicas split the 5 columns differently
    # (3 + 2 at dp 0, 2 + 3 at dp 1): totals agree, the pieces do not fit torch.chunk.
    cols = (3, 2) if dp == 0 else (2, 3)
    out["replica_split"] = _outcome(
        lambda: DTensor.from_local(torch.ones(4, cols[tp]), mesh, [Replicate(), Shard(1)])
    )
    # The tp sub-grids add up to different totals: 3 + 2 at dp 0, 3 + 3 at dp 1.
    cols = (3, 2) if dp == 0 else (3, 3)
    out["totals"] = _outcome(
        lambda: DTensor.from_local(torch.ones(4, cols[tp]), mesh, [Replicate(), Shard(1)])
    )
    # A mesh with no group over all its ranks (a bound torch mesh of several axes over part of
    # the job) gathers along each axis in turn: every row still arrives.
    fallback = DeviceMesh("cpu", mesh.mesh)
    fallback.__dict__["get_mesh_group"] = _no_mesh_group
    with _counting() as calls:
        built = DTensor.from_local(piece, fallback, [Shard(0), Shard(1)])
    out["fallback_calls"] = list(calls)
    out["fallback_full_ok"] = torch.equal(built.full_tensor(), full)
    out["fallback_totals"] = _outcome(
        lambda: DTensor.from_local(torch.ones(4, cols[tp]), fallback, [Replicate(), Shard(1)])
    )
    return out


def _no_mesh_group() -> dist.ProcessGroup:
    raise NotImplementedError("no process group over all ranks of this mesh")


@pytest.mark.multiprocess
def test_two_sharding_axes_one_collective_and_sub_grid_checks() -> None:
    # Mesh (0, 2, 1, 3): rank 0 at (0, 0), rank 2 at (0, 1), rank 1 at (1, 0), rank 3 at (1, 1).
    replica_split = (
        "DTensor.from_local: the local tensor of ranks 1, 3 does not fit Layout([4, 5], "
        "{dp: Replicate(), tp: Shard(1)}): rank 1 has (4, 2) where the layout gives it (4, 3), "
        "rank 3 has (4, 3) where the layout gives it (4, 2)"
    )
    totals = (
        "DTensor.from_local: the local extents of dim 1, sharded over ['tp'], add up to "
        "different global extents: ranks 0, 2 give 5, ranks 1, 3 give 6"
    )
    for result in run_on_ranks(4, _grid_cases):
        assert result["calls"] == ["all_gather_single"]  # before: one gather per axis
        assert result["shape"] == (7, 5)
        assert result["full_ok"]
        assert result["replica_split"] == replica_split
        assert result["totals"] == totals
        assert result["fallback_calls"] == ["all_gather_single"] * 2  # one per axis
        assert result["fallback_full_ok"]
        assert result["fallback_totals"] == totals


def _format(ranks: Sequence[int]) -> str:
    from hp_dtensor.dtensor import _ranks_text

    return _ranks_text(ranks)


def test_rank_lists_are_compressed_into_runs() -> None:
    assert _format([3]) == "rank 3"
    assert _format([2, 0, 1, 3, 6, 8, 9]) == "ranks 0-3, 6, 8-9"
