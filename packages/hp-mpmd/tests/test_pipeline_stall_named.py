"""A pipeline stage that never sends: the stage waiting for it names the transfer, in time.

A fresh job of two gloo ranks (a stall would break the shared pool's group) with a short
collective timeout (6 s), a two-stage GPipe step; rank 1 (the last stage) never posts its
point-to-point operations (it blocks instead). Rank 0 must raise
:class:`hp_dtensor.watchdog.CollectiveTimeoutError` naming the pipeline transfer, its channel
(``'p2p 1->0'``) and rank 1, not gloo's bare ``Timed out waiting 6000ms``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import init_device_mesh
from hp_mpmd import PipelineSchedule, PipelineStage
from hp_mpmd.schedules import gpipe
from hp_testing.fresh_job import never_returns, outcome, run_fresh_job

TIMEOUT_S = 6.0  # the warm-up step must fit on a loaded machine
MARGIN_S = 3.0


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _pipeline_step(rank: int, world: int) -> dict[str, Any]:
    init_device_mesh("cpu", (world,), mesh_dim_names=("pp",), timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(4, 4), rank, world)
    schedule = PipelineSchedule(
        gpipe(world, 2), [stage], _loss, timeout=timedelta(seconds=TIMEOUT_S)
    )
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    schedule.step(x if rank == 0 else None, y if rank == world - 1 else None)  # shapes agreed
    if rank == 1:
        dist.batch_isend_irecv = never_returns  # type: ignore[assignment]
    return outcome(lambda: schedule.step(x if rank == 0 else None, y if rank == 1 else None))


@pytest.mark.multiprocess
def test_a_stall_in_a_pipeline_transfer_is_named() -> None:
    seen = run_fresh_job(2, _pipeline_step, report=[0])[0]
    assert seen["error"] == "CollectiveTimeoutError", seen
    assert seen["collective"].startswith("pipeline recv (gradient"), seen["message"]
    assert seen["group"] == "'p2p 1->0'", seen["message"]
    assert seen["missing"] == [1], seen["message"]
    assert seen["elapsed"] <= TIMEOUT_S + MARGIN_S, seen
