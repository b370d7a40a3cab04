"""Tied and shared parameters under ``fully_shard``, side by side with torch FSDP2 and one device.

A parameter object registered in several modules (an LM head tied to the embedding) must stay
one parameter after sharding: the same object on every owner (the sharded one between steps, the
unsharded one during forward), listed once by ``model.parameters()``, sharded and gathered once,
with one gradient, the sum of every use's contribution; the state dict keeps both names, as
torch FSDP2's does, and loads back under both (nothing missing or unexpected, the tie kept).
Checked on this project's small Llama with its head tied to the embedding (blocks sharded, then
the root; or the two owners passed together, ``fully_shard([emb, head])``) and on Hugging Face's
``LlamaForCausalLM`` with ``tie_word_embeddings=True``, for both parameter layouts and for torch
FSDP2, against the same model trained on one device on the global batch (SGD, so that a gradient
counted once instead of twice, or twice too large, moves the parameters). Owners in two
different ``fully_shard`` groups are refused by both (torch at the first forward, hp-fsdp at the
second ``fully_shard`` call), with ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
BATCH, SEQ, STEPS = 4, 8, 3
# fp32 on CPU, SGD: the sharded runs sum in another order than one device. Measured over 3
# steps, the same for torch FSDP2 and both hp-fsdp layouts: losses within 1.9e-6 (four fp32
# ulps at a loss of 4.2; Hugging Face's model 4.8e-7), gradients within 1.1e-6 of each tensor's
# largest entry (the tied weight's 8.1e-7), parameters within 2.4e-7.
LOSS_TOLERANCE = 4e-6
TOLERANCE = 1e-5
KINDS = ("torch", "flat", "per_param")


def _tied_llama() -> nn.Module:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    model.output.weight = model.tok_embeddings.weight
    return model


def _tied_hf() -> nn.Module:
    import transformers

    from hp_testing.hf import LLAMA_CONFIG

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA_CONFIG, "tie_word_embeddings": True})
    return transformers.LlamaForCausalLM(config)


def _owners(model: nn.Module, which: str) -> tuple[nn.Module, nn.Module]:
    """The embedding and the head tied to it."""
    if which == "hf":
        return model.get_submodule("model.embed_tokens"), model.get_submodule("lm_head")
    return model.get_submodule("tok_embeddings"), model.get_submodule("output")


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _blocks(model: nn.Module, which: str) -> nn.ModuleList:
    blocks = model.get_submodule("model.layers" if which == "hf" else "layers")
    assert isinstance(blocks, nn.ModuleList)
    return blocks


def _shard_fn(kind: str) -> Any:
    world = dist.get_world_size()
    if kind == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        return lambda m: torch_fully_shard(m, mesh=torch_mesh)
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((world,), ("shard",)))
    return lambda m: fully_shard(m, mesh=mesh, param_layout=kind)


def _loss(model: nn.Module, which: str, ids: torch.Tensor) -> torch.Tensor:
    if which == "hf":
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        return loss
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(10 + step))


def _full(t: torch.Tensor, like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The whole value of a parameter or gradient of any of the three kinds."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    if isinstance(t, TorchDTensor):
        return t.full_tensor().detach()
    from hp_dtensor import DeviceMesh
    from hp_dtensor.parallel.equivalence import full_value
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    return full_value(t, mesh, like=like).reshape(shape)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale


def _train_tied(which: str, kind: str, together: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    build = _tied_hf if which == "hf" else _tied_llama
    reference, model = build(), build()
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _shard_fn(kind)
    for block in _blocks(model, which):
        shard(block)
    if together:
        shard(list(_owners(model, which)))
    shard(model)
    emb, head = _owners(model, which)
    seen_in_forward: list[tuple[bool, tuple[int, ...]]] = []

    def look(module: nn.Module, args: Any) -> None:
        del args
        seen_in_forward.append((module.weight is emb.weight, tuple(_weight(module).shape)))

    head.register_forward_pre_hook(look)
    params = list(model.parameters())
    # Elements sharded: the flat layout's pieces summed over the ranks, or global shapes.
    counted = torch.tensor([float(sum(p.numel() for p in params))])
    if kind == "flat":
        dist.all_reduce(counted)
    numel = int(counted.item())
    out: dict[str, Any] = {
        "tied": head.weight is emb.weight,
        "n_params": len(params),
        "numel": numel,
        "want_n_params": len(list(reference.parameters())),
        "want_numel": sum(p.numel() for p in reference.parameters()),
    }
    sd = model.state_dict()
    keys = [k for k in sd if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight")]
    keys += [k for k in sd if k in ("tok_embeddings.weight", "output.weight")]
    out["sd_keys"] = sorted(keys)
    initial = _weight(_owners(reference, which)[0]).detach()
    out["sd_error"] = max(_relative(sd[k].full_tensor(), initial) for k in keys)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_emb = _owners(reference, which)[0]
    loss_error = grad_error = tied_grad_error = 0.0
    for step in range(STEPS):
        ids = _batch(step)
        ref_opt.zero_grad()
        want = _loss(reference, which, ids)
        want.backward()
        opt.zero_grad()
        loss = _loss(model, which, ids.chunk(world)[rank])
        loss.backward()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        loss_error = max(loss_error, abs(total.item() / world - want.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None
            assert q.grad is not None
            grad_error = max(grad_error, _relative(_full(p.grad, p, q.shape), q.grad))
        tied_param, ref_param = _weight(emb), _weight(ref_emb)
        assert tied_param.grad is not None
        assert ref_param.grad is not None
        tied = _full(tied_param.grad, tied_param, ref_param.shape)
        tied_grad_error = max(tied_grad_error, _relative(tied, ref_param.grad))
        ref_opt.step()
        opt.step()
    out["param_error"] = max(
        _relative(_full(p, p, q.shape), q.detach())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    # A state dict round trip: every name loads (none missing or unexpected), the tie holds
    # and the loaded values are the trained reference's (loaded from the reference's own state
    # dict, as DTensors laid out like the model's).
    ref_state = reference.state_dict()
    saved = model.state_dict()
    with torch.no_grad():
        for key, value in saved.items():
            value.copy_(_redistributed(ref_state[key], value))
    result = model.load_state_dict(saved)
    out.update(
        loss_error=loss_error,
        grad_error=grad_error,
        tied_grad_error=tied_grad_error,
        seen_in_forward=seen_in_forward,
        still_tied=head.weight is emb.weight,
        load_keys=list(result.missing_keys) + list(result.unexpected_keys),
        tied_after_load=head.weight is emb.weight,
        loaded_error=max(
            _relative(_full(p, p, q.shape), q.detach())
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        ),
    )
    return out


def _redistributed(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as the state-dict entry ``like`` (this rank's rows of a torch
    DTensor, or ``whole`` for a plain tensor)."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import distribute_tensor

    if isinstance(like, TorchDTensor):
        return distribute_tensor(whole, like.device_mesh, like.placements)
    return whole


def _check(report: dict[str, Any], which: str) -> None:
    assert report["tied"], report
    assert report["still_tied"], report
    assert report["n_params"] == report["want_n_params"], report
    assert report["numel"] == report["want_numel"], report
    vocab_dim = (64, 32)
    assert report["seen_in_forward"] == [(True, vocab_dim)] * STEPS, report
    names = (
        ["lm_head.weight", "model.embed_tokens.weight"]
        if which == "hf"
        else ["output.weight", "tok_embeddings.weight"]
    )
    assert report["sd_keys"] == names, report
    assert report["sd_error"] == 0.0, report
    assert report["loss_error"] < LOSS_TOLERANCE, report
    assert report["tied_grad_error"] < TOLERANCE, report
    assert report["grad_error"] < TOLERANCE, report
    assert report["param_error"] < TOLERANCE, report
    assert report["load_keys"] == [], report
    assert report["tied_after_load"], report
    assert report["loaded_error"] == 0.0, report


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_tied_head_of_llama_stays_one_parameter_as_under_torch_fsdp2(kind: str) -> None:
    for report in run_on_ranks(2, _train_tied, "llama", kind, False, timeout=120):
        _check(report, "llama")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_tied_owners_sharded_together_as_a_list(kind: str) -> None:
    for report in run_on_ranks(2, _train_tied, "llama", kind, True, timeout=120):
        _check(report, "llama")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_hugging_face_tie_word_embeddings(kind: str) -> None:
    for report in run_on_ranks(2, _train_tied, "hf", kind, False, timeout=120):
        _check(report, "hf")


def _owners_in_two_groups(kind: str) -> tuple[str, str]:
    """Shard the embedding alone, then the root holding the tied head: where each refuses."""
    torch.set_num_threads(1)
    model = _tied_llama()
    shard = _shard_fn(kind)
    try:
        shard(model.tok_embeddings)
        shard(model)
        model(_batch(0)[:, :-1])
    except ValueError as error:
        return "raised", str(error)
    return "ran", ""


@pytest.mark.multiprocess
def test_tied_owners_in_two_groups_are_refused_like_torch() -> None:
    for kind in KINDS:
        outcome, message = run_on_ranks(2, _owners_in_two_groups, kind, timeout=60)[0]
        assert outcome == "raised", kind
        assert "fully_shard([module_a, module_b])" in message, (kind, message)
