"""``hyper_parallel.DTensor``: upstream's ``from_local`` does not communicate, hp-dtensor's
checks by default; the facade keeps upstream's behaviour and stays the same type."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hp_dtensor
from hp_testing import run_on_ranks
from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh


def _one_rank_only() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("x",))
    calls: list[str] = []
    real = dist.all_gather_into_tensor

    def counted(*args: object, **kwargs: object) -> object:
        calls.append("all_gather_into_tensor")
        return real(*args, **kwargs)

    dist.all_gather_into_tensor = counted
    try:
        built = None
        if dist.get_rank() == 0:  # as upstream's pipeline example: the first stage only
            built = DTensor.from_local(torch.ones(2, 3), mesh, [Replicate()])
    finally:
        dist.all_gather_into_tensor = real
    return {
        "calls": calls,
        "hp": built is None or type(built) is hp_dtensor.DTensor,
        "is_instance": built is None or isinstance(built, DTensor),
    }


def _checked_on_request() -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("x",))
    local = torch.ones(2, 3 + dist.get_rank())
    try:
        DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_from_local_on_one_rank_only_does_not_communicate() -> None:
    for seen in run_on_ranks(2, _one_rank_only):
        assert seen == {"calls": [], "hp": True, "is_instance": True}


@pytest.mark.multiprocess
def test_the_check_is_there_when_asked() -> None:
    messages = run_on_ranks(2, _checked_on_request)
    assert messages[0] == messages[1]
    assert "rank 0 has 3, rank 1 has 4" in messages[0], messages[0]


def test_it_is_the_same_type_as_hp_dtensor() -> None:
    assert issubclass(hp_dtensor.DTensor, DTensor)
    assert isinstance(torch.ones(1), DTensor) is False
