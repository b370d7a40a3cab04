"""Distributed row blocks, pipelined buckets and checkpoint resharding, against torch.

All runs here use unfused Newton-Schulz (the CPU default), so the distributed results are
compared with ``torch.equal`` to ``torch.optim.Muon`` on whole matrices on one device.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh as torch_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import distribute_tensor as torch_distribute

from _sharders import sharders
from hp_muon import Muon
from hp_testing import run_on_ranks

LR = 0.02
BLOCKS = ((16, 8), (8, 4, 4)), ((2, 12, 6), (6, 3, 3))


def _row_blocks_case(name: str) -> None:
    torch.manual_seed(0)
    world = dist.get_world_size()
    sharder = next(s for s in sharders(world) if s.name == name)
    fulls = [torch.randn(shape) for shape, _ in BLOCKS]
    params = sharder.make(fulls)
    opt = Muon(
        [
            {"params": [p], "row_blocks": blocks}
            for p, (_, blocks) in zip(params, BLOCKS, strict=True)
        ],
        lr=LR,
        weight_decay=0.1,
        fuse_shapes=False,
        ns_dtype=torch.bfloat16,
        **sharder.muon_kwargs(),  # type: ignore[arg-type]
    )
    reference = [
        [nn.Parameter(b.clone()) for m in f.reshape(-1, *f.shape[-2:]) for b in m.split(blocks)]
        for f, (_, blocks) in zip(fulls, BLOCKS, strict=True)
    ]
    ref_opt = torch.optim.Muon([p for ps in reference for p in ps], lr=LR, weight_decay=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        grads = [torch.randn(shape, generator=g) for shape, _ in BLOCKS]
        for p, full in zip(params, grads, strict=True):
            p.grad = sharder.grad(p, full)
        for ps, full, (_, blocks) in zip(reference, grads, BLOCKS, strict=True):
            pieces = [b for m in full.reshape(-1, *full.shape[-2:]) for b in m.split(blocks)]
            for p, piece in zip(ps, pieces, strict=True):
                p.grad = piece.clone()
        opt.step()
        ref_opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    assert dist.get_world_size() > 1
    for p, ps, (shape, blocks) in zip(params, reference, BLOCKS, strict=True):
        got = sharder.full(p)
        rows = [
            torch.cat([r.detach() for r in ps[i : i + len(blocks)]])
            for i in range(0, len(ps), len(blocks))
        ]
        want = torch.stack(rows).reshape(shape)
        assert torch.equal(got, want), (name, (got - want).abs().max().item())
    total = torch.tensor([stats.orthogonalized])
    dist.all_reduce(total)
    assert int(total) == 3 + 2 * 3  # each block of each matrix, once in the whole job


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["hp_fsdp_flat", "torch_fsdp2", "torch_tp", "hp_dtensor"])
def test_row_blocks_distributed(name: str, world: int) -> None:
    run_on_ranks(world, _row_blocks_case, name, timeout=120)


SHAPES = ((18, 8), (3, 8), (8, 18), (12, 20), (20, 12), (3, 6, 4), (2, 3))


def _buckets_case(name: str) -> dict[str, int]:
    """The same step with one bucket and with tiny buckets: equal results, more exchanges."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    sharder = next(s for s in sharders(world) if s.name == name)
    fulls = [torch.randn(s) for s in SHAPES]
    one, many = sharder.make(fulls), sharder.make(fulls)
    opt_one = Muon(one, lr=LR, fuse_shapes=False, ns_dtype=torch.bfloat16, **sharder.muon_kwargs())  # type: ignore[arg-type]
    # 100 bf16 elements per bucket: most matrices get a bucket of their own.
    opt_many = Muon(
        many,
        lr=LR,
        fuse_shapes=False,
        bucket_cap_mb=200 / 2**20,
        ns_dtype=torch.bfloat16,
        **sharder.muon_kwargs(),  # type: ignore[arg-type]
    )
    for step in range(2):
        g = torch.Generator().manual_seed(20 + step)
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for a, b, full in zip(one, many, grads, strict=True):
            a.grad, b.grad = sharder.grad(a, full), sharder.grad(b, full)
        opt_one.step()
        opt_many.step()
    for a, b in zip(one, many, strict=True):
        assert torch.equal(sharder.full(a), sharder.full(b))
    one_stats, many_stats = opt_one.last_step_stats, opt_many.last_step_stats
    assert one_stats is not None
    assert many_stats is not None
    # Bucketing changes how often, not what: the same elements move.
    assert one_stats.elements_sent == many_stats.elements_sent
    return {"one": one_stats.collectives, "many": many_stats.collectives}


@pytest.mark.parametrize("name", ["hp_fsdp_flat", "torch_fsdp2", "torch_hsdp"])
def test_small_buckets_pipeline_to_the_same_result(name: str) -> None:
    results = run_on_ranks(4, _buckets_case, name, timeout=120)
    for r in results:
        assert r["one"] == 2  # one gather, one scatter
        # Several buckets exchange, each with its own gather and scatter (buckets whose
        # matrices each sit on one rank exchange nothing and issue no collective).
        assert r["many"] >= 6


# Checkpoint: torch FSDP2 + hp_muon.Muon saved at one world size, resumed at another -------------

LAYERS = ((8, 18), (18, 3), (3, 20), (20, 12))  # Linear(in, out): weights (18, 8), (3, 18), ...


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in LAYERS))


def _set_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    fulls = [torch.randn(o, i, generator=g) for i, o in LAYERS]
    for p, full in zip(model.parameters(), fulls, strict=True):
        if isinstance(p, TorchDTensor):
            p.grad = torch_distribute(full, p.device_mesh, p.placements)
        else:
            p.grad = full.clone()
    return fulls


def _sharded(seed: int) -> tuple[nn.Module, Muon]:
    mesh = torch_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _model(seed)
    for layer in model:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, Muon(
        model.parameters(), lr=LR, weight_decay=0.1, momentum=0.9, ns_dtype=torch.bfloat16
    )


def _save_case(path: str, steps: int) -> None:
    model, opt = _sharded(seed=0)
    for step in range(steps):
        _set_grads(model, step)
        opt.step()
    dcp_save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=path,
    )


def _resume_case(path: str, first: int, steps: int) -> None:
    model, opt = _sharded(seed=1)  # different values: everything must come from the checkpoint
    model_sd, optim_sd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, opt, optim_sd)
    momentum = next(iter(opt.state.values()))["momentum_buffer"]
    assert isinstance(momentum, TorchDTensor)
    for step in range(first, first + steps):
        _set_grads(model, step)
        opt.step()

    reference = _model(seed=0)
    ref_opt = torch.optim.Muon(reference.parameters(), lr=LR, weight_decay=0.1, momentum=0.9)
    for step in range(first + steps):
        _set_grads(reference, step)
        ref_opt.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, TorchDTensor)
        got = p.full_tensor()
        assert torch.equal(got, r.detach()), (name, (got - r).abs().max().item())
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        buf = opt.state[p]["momentum_buffer"]
        assert torch.equal(buf.full_tensor(), ref_opt.state[r]["momentum_buffer"])


@pytest.mark.parametrize(("save_world", "load_world"), [(4, 2), (2, 4)])
def test_dcp_checkpoint_reshards_momentum(tmp_path: Path, save_world: int, load_world: int) -> None:
    """Save after 2 steps on ``save_world`` ranks, resume for 2 on ``load_world``: bit-equal to 4
    uninterrupted steps of torch.optim.Muon on one device (parameters and momentum)."""
    path = os.fspath(tmp_path / "ckpt")
    run_on_ranks(save_world, _save_case, path, 2, timeout=120)
    run_on_ranks(load_world, _resume_case, path, 2, 2, timeout=120)


def test_state_dict_is_sharded_like_the_parameters() -> None:
    run_on_ranks(2, _state_dict_case, timeout=60)


def _state_dict_case() -> None:
    model, opt = _sharded(seed=0)
    _set_grads(model, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(model.parameters()):
        buf = sd["state"][i]["momentum_buffer"]
        assert isinstance(buf, TorchDTensor)
        assert isinstance(p, TorchDTensor)
        assert buf.placements == p.placements
        assert buf.to_local().shape == p.to_local().shape


def _overlap_case() -> list[str]:
    """Record, on this rank, the order of all-to-all issues and Newton-Schulz runs."""
    import hp_muon.muon as muon_module

    torch.manual_seed(0)
    sharder = next(s for s in sharders(dist.get_world_size()) if s.name == "torch_fsdp2")
    shapes = [(16, 16)] * 6  # one matrix per bucket; every one gathered across ranks
    fulls = [torch.randn(s) for s in shapes]
    params = sharder.make(fulls)
    opt = Muon(params, lr=LR, bucket_cap_mb=256 * 2 / 2**20, ns_dtype=torch.bfloat16)
    for p, f in zip(params, fulls, strict=True):
        p.grad = sharder.grad(p, f)
    events: list[str] = []
    ns_name = "orthogonalize_counted"  # patched where Muon looks it up
    real_a2a, real_ns = dist.all_to_all_single, getattr(muon_module, ns_name)

    def a2a(*args: object, **kwargs: object) -> object:
        events.append("a2a")
        return real_a2a(*args, **kwargs)  # type: ignore[arg-type]

    def ns(
        matrices: list[torch.Tensor], *args: object, **kwargs: object
    ) -> tuple[list[torch.Tensor], int]:
        events.append(f"ns{len(matrices)}")
        out: tuple[list[torch.Tensor], int] = real_ns(matrices, *args, **kwargs)
        return out

    dist.all_to_all_single = a2a
    setattr(muon_module, ns_name, ns)
    try:
        opt.step()
    finally:
        dist.all_to_all_single = real_a2a
        setattr(muon_module, ns_name, real_ns)
    return events


def test_next_gather_is_in_flight_during_newton_schulz() -> None:
    """Six buckets on two ranks: the gather of bucket k+1 is issued before bucket k is
    orthogonalized, and its scatter before bucket k+1's Newton-Schulz."""
    for events in run_on_ranks(2, _overlap_case, timeout=60):
        owned = [i for i, e in enumerate(events) if e.startswith("ns")]
        a2a = [i for i, e in enumerate(events) if e == "a2a"]
        assert len(a2a) == 12  # 6 buckets x (gather + scatter)
        assert len(owned) == 3  # this rank owns half of the six matrices
        # Issue order: g0, then per bucket k: g(k+1), NS k (if owned), s(k). So before NS k,
        # 2k + 2 all-to-alls were issued (gathers 0..k+1, scatters 0..k-1): the next gather is
        # in flight. A serial gather-NS-scatter order would show 2k + 1. The last bucket has no
        # next gather: 2 * 5 + 1 = 11.
        for i in owned:
            issued = sum(1 for j in a2a if j < i)
            assert issued % 2 == 0 or issued == 11, events


def _wire_dtypes_case(ns_dtype: torch.dtype) -> tuple[list[str], int, int]:
    """The dtypes of the all-to-alls of one step, the bytes they carried and the bytes the
    step's stats report."""
    torch.manual_seed(0)
    sharder = next(s for s in sharders(dist.get_world_size()) if s.name == "torch_fsdp2")
    fulls = [torch.randn(s) for s in [(16, 24), (24, 16), (32, 8)]]
    params = sharder.make(fulls)
    opt = Muon(params, lr=LR, ns_dtype=ns_dtype)
    for p, f in zip(params, fulls, strict=True):
        p.grad = sharder.grad(p, f)
    dtypes: list[str] = []
    sent = 0
    real_a2a = dist.all_to_all_single

    def a2a(output: torch.Tensor, input: torch.Tensor, *args: object, **kwargs: object) -> object:
        nonlocal sent
        dtypes.append(str(input.dtype))
        sent += input.nbytes
        return real_a2a(output, input, *args, **kwargs)  # type: ignore[arg-type]

    dist.all_to_all_single = a2a
    try:
        opt.step()
    finally:
        dist.all_to_all_single = real_a2a
    stats = opt.last_step_stats
    assert stats is not None
    return dtypes, sent, stats.bytes_sent


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_inputs_and_results_travel_in_bf16(ns_dtype: torch.dtype) -> None:
    """Whatever the iteration's precision, gathers and scatters carry bf16, as the stats (and
    the dry run's model of the exchange) say."""
    for dtypes, sent, reported in run_on_ranks(2, _wire_dtypes_case, ns_dtype, timeout=60):
        assert dtypes
        assert set(dtypes) == {"torch.bfloat16"}, dtypes
        # Stats count the elements this rank sends to others; the buffers also hold what a
        # rank keeps for itself, so the wire is at least what the stats report.
        assert sent >= reported > 0, (sent, reported)
