"""``hyper_parallel.fully_shard(plan=...)`` reaches hp-fsdp: a planner's plan of the call
(``hp_fsdp.plan_fully_shard``, for the per-parameter layout the umbrella asks for) is accepted,
a plan of the flat layout is refused naming the field that differs (world 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_testing import run_on_ranks


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))


def _given_plans() -> str:
    from hp_fsdp import plan_fully_shard
    from hyper_parallel import fully_shard, init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        meta = _model()
    rows = plan_fully_shard(meta, mesh, param_layout="per_param")
    flat = plan_fully_shard(meta, mesh)
    fully_shard(_model(), mesh=mesh, plan=rows)
    with pytest.raises(ValueError, match="the given plan differs") as error:
        fully_shard(_model(), mesh=mesh, plan=flat)
    return str(error.value)


@pytest.mark.multiprocess
def test_plan_is_passed_to_hp_fsdp() -> None:
    for message in run_on_ranks(2, _given_plans):
        assert "field layouts[0]" in message
