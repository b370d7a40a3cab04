"""Gradient reduce-scatters left in flight behind the next group's backward
(``hp_fsdp.reduce_overlap``), observed, and the buffers a reduce-scatter holds.

* The decision, against its rule written out here: held exactly when the group communicates
  and is not the first reduced in the backward.
* The step: ``hp_testing.llama.Llama`` (three blocks and the root, fp32) on world 2. Every
  gradient reduce-scatter is wrapped as it is issued so that its issue and its wait are logged,
  between markers logged when each block's backward starts (its output's gradient arrives).
  The first reduce-scatter of the backward (the last block's) is waited for before the next
  block's backward starts; each later one is waited for only after the backward that follows
  it: the next block's, or the embedding's for the first block, and at the end for the root.
  The same under the backend's own reduce-scatter primitive. The values are untouched: the
  other tests of this package (one device, torch FSDP2) run through it.
* The all-to-all reduce-scatter over a pair of ranks receives its one row straight into the
  output (bit-equal sum, ``c0 + c1 == c1 + c0``): it allocates nothing. Over four ranks the end
  ranks allocate a receive buffer of three chunks, the middle ones of four.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_fsdp.reduce_overlap import decide_reduce_overlap
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
# Backward order of the groups: the blocks from the last, then the root.
REDUCED = ["layers.2", "layers.1", "layers.0", "root"]


def test_held_exactly_when_it_communicates_and_is_not_the_first() -> None:
    for reduced_before, communicates in itertools.product(range(6), (False, True)):
        decision = decide_reduce_overlap(reduced_before, communicates)
        assert decision.hold == (communicates and reduced_before >= 1), decision
        assert decision.reason
    with pytest.raises(ValueError, match="reduced_before must be at least 0, got -1"):
        decide_reduce_overlap(-1, True)


class _Logged:
    """A reduce-scatter's handle that logs its wait."""

    def __init__(self, work: Any, name: str, log: list[tuple[str, str]]) -> None:
        self.work, self.name, self.log = work, name, log

    def wait(self) -> Any:
        self.log.append(("wait", self.name))
        return self.work.wait() if self.work is not None else True


def _step_log(primitive: str) -> list[tuple[str, str]]:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_fsdp._collectives import ReduceScatterPrimitive, reduce_scatter_by
    from hp_fsdp._group import FSDPParamGroup
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    log: list[tuple[str, str]] = []
    for index, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh)

        def mark(_m: Any, _i: Any, out: torch.Tensor, name: str = f"layers.{index}") -> None:
            def started(_grad: torch.Tensor) -> None:
                log.append(("backward", name))

            out.register_hook(started)

        block.register_forward_hook(mark)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    original = FSDPParamGroup.reduce_scatter

    def logged(group: Any, output: torch.Tensor) -> Any:
        name = REDUCED[sum(kind == "issue" for kind, _ in log)]
        log.append(("issue", name))
        return _Logged(original(group, output), name, log)

    def step() -> None:
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    with reduce_scatter_by(ReduceScatterPrimitive(primitive)):
        step()  # warm-up: lazy initialization
        log.clear()
        FSDPParamGroup.reduce_scatter = logged  # type: ignore[method-assign,assignment]
        try:
            step()
        finally:
            FSDPParamGroup.reduce_scatter = original  # type: ignore[method-assign]
    return log


@pytest.mark.multiprocess
@pytest.mark.parametrize("primitive", ["all_to_all", "native"])
def test_reduce_scatters_after_the_first_wait_behind_the_next_backward(primitive: str) -> None:
    want = [
        ("backward", "layers.2"),
        ("issue", "layers.2"),
        ("wait", "layers.2"),  # the first: at once
        ("backward", "layers.1"),
        ("issue", "layers.1"),
        ("backward", "layers.0"),
        ("wait", "layers.1"),  # held through layers.0's backward
        ("issue", "layers.0"),
        ("wait", "layers.0"),  # held through the embedding's backward, until the root's turn
        ("issue", "root"),
        ("wait", "root"),  # held until the end of backward
    ]
    for log in run_on_ranks(2, _step_log, primitive):
        assert log == want


def _pair_reduce_scatter(numel: int) -> dict[str, Any]:
    from hp_fsdp._collectives import ReduceScatterPrimitive, reduce_scatter
    from hp_fsdp.counting import PeakMemoryMode

    world, rank = dist.get_world_size(), dist.get_rank()

    def contribution(r: int) -> torch.Tensor:
        return (torch.arange(world * numel, dtype=torch.float32) * 0.37 + r) / (r + 3)

    source = contribution(rank)
    output = torch.full((numel,), float("nan"))
    with PeakMemoryMode() as memory:
        primitive = ReduceScatterPrimitive.ALL_TO_ALL
        reduce_scatter(output, source, dist.group.WORLD, world, primitive).wait()
    rows = [contribution(r).view(world, numel)[rank] for r in range(world)]
    want = rows[0].clone()
    for row in rows[1:]:
        want += row
    return {"equal": torch.equal(output, want), "allocated": memory.peak_increase}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_a_pair_reduce_scatter_allocates_no_receive_buffer(world: int) -> None:
    numel = 1000
    for rank, result in enumerate(run_on_ranks(world, _pair_reduce_scatter, numel)):
        assert result["equal"], (world, rank)
        chunks = 0 if world == 2 else (world - 1 if rank in (0, world - 1) else world)
        assert result["allocated"] == chunks * numel * 4, (world, rank, result)
