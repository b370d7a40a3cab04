"""Activation checkpointing's recompute inside backward, with FSDP groups nested in a
checkpointed block.

``hp_testing.llama.Llama`` (fp32, three blocks) on world 2, each block wrapped by torch's
``checkpoint_wrapper`` (non-reentrant), each block's feed-forward its own FSDP group inside the
block's: the recompute reruns the feed-forward's forward hooks inside backward. There they only
unshard: a prefetch of the next group in forward order would all-gather the next block again,
whose backward has already run (two needless all-gathers per step here), and a reshard would
free the parameters its backward is about to use.

* Parameter all-gathers per step: the root once (never resharded), each block and each
  feed-forward twice (forward, backward): 13.
* Loss and every gradient equal those of the same model without checkpointing, bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
GATHERS_PER_STEP = 1 + 2 * CONFIG.n_layers + 2 * CONFIG.n_layers


def _model(checkpointed: bool) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    layers: Any = model.layers
    for i, block in enumerate(layers):
        fully_shard(block.ffn, mesh=mesh)
        layers[i] = checkpoint_wrapper(block) if checkpointed else block
        fully_shard(layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, step: int) -> float:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.item()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    # checkpoint_wrapper adds a prefix to the names below it: compare by position in the model.
    return {
        str(i): p.grad.detach().clone()
        for i, p in enumerate(model.parameters())
        if p.grad is not None
    }


def _run(checkpointed: bool) -> dict[str, Any]:
    from hp_fsdp.counting import CountingMode

    torch.set_num_threads(1)
    model = _model(checkpointed)
    _step(model, 0)  # records the forward order the implicit prefetch follows
    model.zero_grad(set_to_none=True)
    with CountingMode() as counts:
        loss = _step(model, 1)
    gathers = sum(1 for c in counts.collectives if c.purpose == "param_all_gather")
    return {"loss": loss, "gathers": gathers, "grads": _grads(model)}


def _both() -> dict[bool, dict[str, Any]]:
    return {checkpointed: _run(checkpointed) for checkpointed in (False, True)}


@functools.cache
def _results() -> list[dict[bool, dict[str, Any]]]:
    return run_on_ranks(2, _both)


def test_recompute_gathers_only_what_backward_needs() -> None:
    for rank in _results():
        assert rank[False]["gathers"] == GATHERS_PER_STEP
        assert rank[True]["gathers"] == GATHERS_PER_STEP


def test_recompute_changes_no_number() -> None:
    for rank in _results():
        plain, checkpointed = rank[False], rank[True]
        assert checkpointed["loss"] == plain["loss"]
        assert plain["grads"].keys() == checkpointed["grads"].keys()
        assert len(plain["grads"]) == len(list(Llama(CONFIG).parameters()))
        for key, grad in plain["grads"].items():
            assert torch.equal(checkpointed["grads"][key], grad), key
