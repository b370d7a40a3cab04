"""DTensor at 768 ranks without processes: a fake process group and meta tensors.

The fake backend completes every collective without moving data, so this checks what can be
checked at that scale: process groups along each axis, layouts and local shapes through ops and
redistributions, on a rank in the middle of the mesh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _harness import as_dtensor
from hp_dtensor import DeviceMesh, DTensor
from hp_layout import Layout, Mesh, Partial, Placement, Replicate, Shard
from hp_testing import fake_world

WORLD = 768


def test_tensor_parallel_ops_at_768_ranks() -> None:
    rank = 301
    with fake_world(WORLD, rank=rank):
        mesh = DeviceMesh("cpu", Mesh((96, 8), ("dp", "tp")))
        dp, tp = mesh.get_coordinate() or (None, None)
        assert (dp, tp) == (rank // 8, rank % 8)
        assert mesh.get_group("tp").size() == 8
        assert mesh.get_group("dp").size() == 96

        def dtensor(shape: tuple[int, ...], placements: list[Placement]) -> DTensor:
            layout = Layout(shape, mesh.mesh, placements)
            local = torch.empty(layout.local_shape(rank), device="meta")
            return DTensor.from_local(local, mesh, layout.placements, shape=shape)

        x = dtensor((1000, 4096), [Shard(0), Replicate()])  # 1000 rows over 96: uneven
        w_col = dtensor((11008, 4096), [Replicate(), Shard(0)])
        w_row = dtensor((4096, 11008), [Replicate(), Shard(1)])
        h = as_dtensor(F.silu(F.linear(x, w_col)))
        assert h.placements == (Shard(0), Shard(1))
        assert tuple(h.to_local().shape) == (11, 11008 // 8)
        out = as_dtensor(F.linear(h, w_row))
        assert out.placements == (Shard(0), Partial())
        reduced = out.redistribute(placements=[Shard(0), Shard(1)])
        assert tuple(reduced.to_local().shape) == (11, 4096 // 8)
        loss = as_dtensor(reduced.float().pow(2).mean())
        assert loss.placements == (Partial(), Partial())
        assert loss.to_local().device.type == "meta"
