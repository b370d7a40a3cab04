"""A rank that never joins hp-fsdp's low-precision all-gather: the others name it, in time.

A fresh job of two gloo ranks (a stall would break the shared pool's group) with a 4 s
collective timeout: a model under ``fully_shard`` with an FP8 parameter all-gather
(``LowPrecisionCommPolicy``); rank 1 never issues the all-gather of the FP8 records (it blocks
instead). Rank 0 must raise :class:`hp_dtensor.watchdog.CollectiveTimeoutError` naming the
codec's all-gather and rank 1, not gloo's bare ``Timed out waiting 4000ms``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import init_device_mesh
from hp_fsdp import LowPrecisionCommPolicy, fully_shard
from hp_testing.fresh_job import never_returns, outcome, run_fresh_job

TIMEOUT_S = 4.0
MARGIN_S = 3.0


def _fp8_unshard(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",), timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    comm = LowPrecisionCommPolicy(param_all_gather_dtype=torch.float8_e4m3fn)
    model = fully_shard(nn.Linear(64, 64), mesh=mesh, comm_policy=comm)
    if rank == 1:
        dist.all_gather_single = never_returns
    return outcome(lambda: model(torch.randn(2, 64)))


@pytest.mark.multiprocess
def test_a_stall_in_the_fp8_all_gather_is_named() -> None:
    seen = run_fresh_job(2, _fp8_unshard, report=[0])[0]
    assert seen["error"] == "CollectiveTimeoutError", seen
    assert seen["collective"] == "all_gather (FSDP low-precision records, param_all_gather)"
    assert seen["missing"] == [1], seen["message"]
    assert "rank 1 of the group did not arrive" in seen["message"]
    assert seen["elapsed"] <= TIMEOUT_S + MARGIN_S, seen
