"""A rank that never joins Muon's exchange: the others name it and the exchange, in time.

A fresh job of two gloo ranks (a stall would break the shared pool's group) with a 4 s
collective timeout: a model sharded by torch FSDP2, one ``hp_muon.Muon`` step; rank 1 never
issues the exchange's all-to-all (it blocks instead). Rank 0 must raise
:class:`hp_dtensor.watchdog.CollectiveTimeoutError` naming the Muon exchange and rank 1, not
gloo's bare ``Timed out waiting 4000ms``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from hp_dtensor import init_device_mesh
from hp_muon import Muon
from hp_testing.fresh_job import never_returns, outcome, run_fresh_job

TIMEOUT_S = 4.0
MARGIN_S = 3.0


def _muon_step(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",), timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh.to_torch())
    optimizer = Muon(model.parameters(), lr=0.02)
    model(torch.randn(3, 8)).sum().backward()
    if rank == 1:
        dist.all_to_all_single = never_returns
    return outcome(optimizer.step)


@pytest.mark.multiprocess
def test_a_stall_in_the_muon_exchange_is_named() -> None:
    seen = run_fresh_job(2, _muon_step, report=[0])[0]
    assert seen["error"] == "CollectiveTimeoutError", seen
    assert seen["collective"] == "all_to_all (Muon exchange)", seen["message"]
    assert seen["missing"] == [1], seen["message"]
    assert "rank 1 of the group did not arrive" in seen["message"]
    assert seen["elapsed"] <= TIMEOUT_S + MARGIN_S, seen
