"""``CPUOffloadPolicy``: sharded parameters, gradients and optimizer state in host memory.

On a CPU mesh the host is the device, but the offload path runs all the same: each unshard
copies the host shard into a device staging buffer before the all-gather, and each reduced
gradient chunk is copied back into a host buffer that the sharded gradients are views of. The
test counts those copies (one per all-gather and one per reduce-scatter, asserted exactly) and
asserts that training with offload equals training without it bit for bit (AdamW, 3 steps, fp32:
losses and every final parameter piece), on a 1-d mesh at world 2 and HSDP (2, 2) at world 4,
with this package's policy and with torch's ``torch.distributed.fsdp.CPUOffloadPolicy``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_dtensor import DeviceMesh
from hp_fsdp import CPUOffloadPolicy, fully_shard
from hp_fsdp.counting import CountingMode
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
STEPS = 3


def _train(policy_kind: str, hsdp: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape, names = ((2, 2), ("replicate", "shard")) if hsdp else ((world,), ("shard",))
    mesh = DeviceMesh("cpu", Mesh(shape, names))
    policy: Any = None
    if policy_kind == "hp":
        policy = CPUOffloadPolicy(pin_memory=False)
    elif policy_kind == "torch":
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

        policy = TorchCPUOffloadPolicy(pin_memory=False)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    losses, copies = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (2 * world, 8), generator=g).chunk(world)[rank]
        optimizer.zero_grad()
        with CountingMode() as counting:
            logits = model(ids)
            loss = F.cross_entropy(
                logits.reshape(-1, CONFIG.vocab_size), ids.roll(1, 1).reshape(-1)
            )
            loss.backward()
        copies.append(counting.copy_count)
        optimizer.step()
        losses.append(loss.item())
    states = [s for s in (getattr(m, "_hp_fsdp_state", None) for m in model.modules()) if s]
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "copies": copies,
        "groups": sum(len(s.groups) for s in states),
        "offloaded": all(g.offload is not None for s in states for g in s.groups),
        "grads_on_host": all(
            p.grad is None or p.grad.device.type == "cpu" for p in model.parameters()
        ),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)])
def test_cpu_offload_equals_no_offload(world: int, hsdp: bool) -> None:
    plain = run_on_ranks(world, _train, "none", hsdp, timeout=300)
    for kind in ("hp", "torch"):
        offloaded = run_on_ranks(world, _train, kind, hsdp, timeout=300)
        for ours, base in zip(offloaded, plain, strict=True):
            assert ours["offloaded"]
            assert ours["grads_on_host"]
            assert ours["losses"] == base["losses"]
            for a, b in zip(ours["params"], base["params"], strict=True):
                assert torch.equal(a, b)
            # Per step: the 2 blocks gather twice (forward, backward), the root once, and
            # every group's reduced chunk comes back once: 5 + 3 host<->device copies.
            groups = ours["groups"]
            extra = (2 * (groups - 1) + 1) + groups
            assert [c - b for c, b in zip(ours["copies"], base["copies"], strict=True)] == [
                extra
            ] * STEPS, (ours["copies"], base["copies"])
