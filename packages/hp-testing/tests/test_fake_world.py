"""fake_world: torch's fake process-group backend in this process, at large world sizes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hp_testing import fake_world, rank, world_size

FakeWorld = Callable[..., AbstractContextManager[dist.ProcessGroup]]


def test_device_mesh_at_world_768() -> None:
    with fake_world(768, rank=100) as group:
        assert group is dist.group.WORLD
        assert (rank(), world_size(), dist.get_backend()) == (100, 768, "fake")
        mesh = init_device_mesh("cpu", (8, 96), mesh_dim_names=("dp", "tp"))
        assert mesh.shape == (8, 96)
        assert list(mesh.get_coordinate() or ()) == [1, 4]  # 100 = 1 * 96 + 4
        assert mesh["tp"].size() == 96
        assert mesh["dp"].size() == 8
        tp_group = mesh.get_group("tp")
        assert dist.get_process_group_ranks(tp_group) == list(range(96, 192))
        assert dist.get_process_group_ranks(mesh.get_group("dp")) == list(range(4, 768, 96))

        # Collectives are traced, not executed: meta tensors in, nothing allocated or moved.
        grad = torch.empty(4096, 4096, device="meta")
        dist.all_reduce(grad, group=tp_group)
        shards = [torch.empty(16, 4096, device="meta") for _ in range(8)]
        dist.all_gather(shards, torch.empty(16, 4096, device="meta"), group=mesh.get_group("dp"))
        assert grad.shape == (4096, 4096)
        assert grad.device.type == "meta"

        # And on real tensors the data is left alone (no sum happened).
        ones = torch.ones(3)
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()


def test_refuses_nesting_and_existing_group() -> None:
    with fake_world(64):
        with pytest.raises(RuntimeError, match="already initialized"), fake_world(8):
            pass  # pragma: no cover
        assert dist.get_world_size() == 64  # the outer world is untouched
    assert not dist.is_initialized()


def test_destroys_group_on_error() -> None:
    with pytest.raises(ZeroDivisionError), fake_world(16, rank=3):
        _ = 1 / 0
    assert not dist.is_initialized()
    with fake_world(16, rank=15):  # and can be entered again
        assert rank() == 15


@pytest.mark.parametrize(("world", "r"), [(0, 0), (4, 4), (4, -1), (True, 0)])
def test_bad_arguments(world: int, r: int) -> None:
    with pytest.raises(ValueError, match="fake_world"), fake_world(world, r):
        pass  # pragma: no cover
    assert not dist.is_initialized()


def test_helpers_need_a_group() -> None:
    with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
        rank()


def test_fixture(fake_world: FakeWorld) -> None:
    with fake_world(256, rank=7) as group:
        assert group.size() == 256
        assert group.rank() == 7
