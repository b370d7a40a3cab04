"""hp-fsdp's parameter all-gather (``hp_fsdp._collectives.all_gather``) against the gathered
buffer written out in the test: every rank's shard is a formula of its rank, so the expected
output is their concatenation in rank order. Over a pair of gloo ranks it is an exchange (an
all-to-all into the peer's slice and a copy of the own shard), over four gloo's all-gather;
both must fill every element (the output starts as a sentinel), in fp32, bf16 and the bytes FP8
parameters travel as, and the counter must see it as what it carries: the whole gathered buffer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_fsdp._collectives import all_gather
from hp_fsdp.counting import CountingMode, collective_purpose
from hp_testing import run_on_ranks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


def _shard(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(numel) * 3 + 100 * rank + 1
    return (values % 251).to(dtype)


def _gather(numel: int, dtype_name: str) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = _shard(rank, numel, dtype)
    output = torch.full((world * numel,), 255 if dtype == torch.uint8 else float("nan"))
    output = output.to(dtype)
    with CountingMode() as counts, collective_purpose("param_all_gather"):
        all_gather(output, shard, dist.group.WORLD, world).wait()
    want = torch.cat([_shard(r, numel, dtype) for r in range(world)])
    calls = [(c.kind, c.nbytes, c.purpose) for c in counts.collectives]
    return {"equal": torch.equal(output, want), "calls": calls}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "uint8"])
def test_all_gather_fills_the_ranks_shards_in_order(world: int, dtype_name: str) -> None:
    itemsize = DTYPES[dtype_name].itemsize
    for numel in (7, 4096):
        for result in run_on_ranks(world, _gather, numel, dtype_name, timeout=60):
            assert result["equal"], (world, dtype_name, numel)
            kind = "all_to_all" if world == 2 else "all_gather"
            assert result["calls"] == [(kind, world * numel * itemsize, "param_all_gather")]
