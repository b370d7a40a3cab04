"""Checkpoints of fully_shard'ed models: state dicts are torch DTensors (FSDP2 layout) equal to
the single-device parameters, and a checkpoint saved with torch.distributed.checkpoint at
world 4 (1-d FSDP and HSDP 2x2) resumes at world 2 exactly where the world-4 run goes; an
FSDP x TP checkpoint (2x2 (dp, tp)) keeps the tensor-parallel placements and loads into 1-d
FSDP at world 2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ParallelStyle, parallelize_module, transformer_tp_plan
from hp_fsdp import fully_shard
from hp_fsdp.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

SAVED_AFTER = 2  # steps before the checkpoint
CONTINUE = 3  # steps after it
BATCH = 8
LR = 0.02
LLAMA = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.tanh(self.up(x)))
        return out


class Net(nn.Module):
    """Two blocks and root parameters; every size is uneven over 2 and 4 shards somewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 5)
        self.blocks = nn.ModuleList([Block(5, 7), Block(5, 9)])
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _mesh(shape: tuple[int, ...]) -> DeviceMesh:
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return DeviceMesh("cpu", Mesh(shape, names))


def _sharded(seed: int, mesh: DeviceMesh) -> Net:
    torch.manual_seed(seed)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 2, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, sharded: bool) -> float:
    """One step on the global batch (each rank on its part); returns the global loss."""
    x, y = _batch(step)
    if sharded:
        world, rank = dist.get_world_size(), dist.get_rank()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    value = loss.detach().clone()
    if sharded:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _full(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Whole values of a state dict's torch DTensors (collective)."""
    out = {}
    for key, value in state_dict.items():
        assert isinstance(value, TorchDTensor), (key, type(value))
        out[key] = value.full_tensor()
    return out


def _max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _save_run(paths: dict[str, str]) -> dict[str, Any]:
    """World 4: train, check the state dicts, save, continue; per case the continuation."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for kind, path in paths.items():
        if kind == "fsdp_tp":
            out[kind] = _save_tp(path)
            continue
        mesh = _mesh((4,) if kind == "fsdp" else (2, 2))
        torch.manual_seed(0)
        reference = Net()
        ref_opt = _optimizer(reference)
        model = _sharded(0, mesh)
        opt = _optimizer(model)
        for step in range(SAVED_AFTER):
            _step(reference, ref_opt, step, sharded=False)
            _step(model, opt, step, sharded=True)
        sd = model.state_dict()
        want = [TorchShard(0)] if kind == "fsdp" else [TorchReplicate(), TorchShard(0)]
        placements = {tuple(v.placements) == tuple(want) for v in sd.values()}
        shapes = {tuple(v.shape) == tuple(reference.state_dict()[k].shape) for k, v in sd.items()}
        osd = get_optimizer_state_dict(model, opt)
        ref_state = {
            name: ref_opt.state[p]["exp_avg_sq"] for name, p in reference.named_parameters()
        }
        moments = {k: v["exp_avg_sq"] for k, v in osd["state"].items()}
        steps = {float(v["step"]) for v in osd["state"].values()}
        dcp_save({"model": sd, "optim": osd}, checkpoint_id=path)
        result = {
            "placements_ok": placements == {True},
            "shapes_ok": shapes == {True},
            "param_error": _max_error(_full(sd), dict(reference.state_dict())),
            "moment_error": _max_error(_full(moments), ref_state),
            "steps": sorted(steps),
            "losses": [_step(model, opt, SAVED_AFTER + i, sharded=True) for i in range(CONTINUE)],
            "final": _full(model.state_dict()),
        }
        out[kind] = result
    return out


def _load_run(paths: dict[str, str]) -> dict[str, Any]:
    """World 2 (1-d): load each checkpoint into a differently initialized model, continue."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for kind, path in paths.items():
        if kind == "fsdp_tp":
            out[kind] = _load_tp(path)
            continue
        mesh = _mesh((2,))
        model = _sharded(1, mesh)
        opt = _optimizer(model)
        pieces = [id(p) for p in model.parameters()]
        # Plain whole tensors load too (a single-device state dict).
        torch.manual_seed(7)
        single = Net()
        model.load_state_dict(single.state_dict())
        plain_error = _max_error(_full(model.state_dict()), dict(single.state_dict()))
        try:
            model.load_state_dict({**single.state_dict(), "head.weight": torch.zeros(3, 3)})
            mismatch = ""
        except RuntimeError as error:
            mismatch = str(error)
        sd = model.state_dict()
        osd = get_optimizer_state_dict(model, opt)
        dcp_load({"model": sd, "optim": osd}, checkpoint_id=path)
        model.load_state_dict(sd)
        set_optimizer_state_dict(model, opt, osd)
        held = [id(p) for group in opt.param_groups for p in group["params"]]
        out[kind] = {
            "plain_error": plain_error,
            "mismatch": mismatch,
            "same_objects": pieces == [id(p) for p in model.parameters()] == held,
            "losses": [_step(model, opt, SAVED_AFTER + i, sharded=True) for i in range(CONTINUE)],
            "final": _full(model.state_dict()),
        }
    return out


# FSDP x TP ----------------------------------------------------------------------------------


def _tp_plan() -> dict[str, ParallelStyle]:
    return transformer_tp_plan()


def _llama(seed: int, tp: bool) -> Llama:
    """Llama under FSDP: on the dp axis of a (dp, tp) 2x2 mesh over TP, or 1-d over all ranks."""
    torch.manual_seed(seed)
    model = Llama(LLAMA)
    if tp:
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
        parallelize_module(model, mesh, _tp_plan(), mode="production", tp_axis="tp")
        mesh = mesh["dp"]
    else:
        mesh = _mesh((dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _llama_step(model: nn.Module, opt: torch.optim.Optimizer, dp: int, dp_size: int) -> None:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, LLAMA.vocab_size, (4, 6), generator=g).chunk(dp_size)[dp]
    targets = torch.randint(0, LLAMA.vocab_size, (4, 6), generator=g).chunk(dp_size)[dp]
    opt.zero_grad()
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    opt.step()


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)


def _save_tp(path: str) -> dict[str, Any]:
    """World 4, FSDP over TP: one step; placements and values of the state dict; save."""
    torch.manual_seed(0)
    reference = Llama(LLAMA)
    ref_opt = _optimizer(reference)
    model = _llama(0, tp=True)
    opt = _optimizer(model)
    init_error = _max_error(_full(model.state_dict()), dict(reference.state_dict()))
    _llama_step(reference, ref_opt, 0, 1)
    _llama_step(model, opt, dist.get_rank() // 2, 2)
    sd = model.state_dict()
    osd = get_optimizer_state_dict(model, opt)
    dcp_save({"model": sd, "optim": osd}, checkpoint_id=path)
    return {
        "placements": {k: tuple(v.placements) for k, v in sd.items()},
        "init_error": init_error,
        "param_error": _relative_error(_full(sd), dict(reference.state_dict())),
        "params": _full(sd),
        "moments": _full({k: v["exp_avg"] for k, v in osd["state"].items()}),
    }


def _load_tp(path: str) -> dict[str, Any]:
    """World 2, 1-d FSDP without TP: load the FSDP x TP checkpoint."""
    model = _llama(1, tp=False)
    opt = _optimizer(model)
    sd = model.state_dict()
    osd = get_optimizer_state_dict(model, opt)
    dcp_load({"model": sd, "optim": osd}, checkpoint_id=path)
    model.load_state_dict(sd)
    set_optimizer_state_dict(model, opt, osd)
    osd = get_optimizer_state_dict(model, opt)
    return {
        "params": _full(model.state_dict()),
        "moments": _full({k: v["exp_avg"] for k, v in osd["state"].items()}),
    }


def _check_tp(before: dict[str, Any], after: dict[str, Any]) -> None:
    placements = before["placements"]
    # FSDP2's layout: the dp shard nests inside a tensor-parallel Shard(0).
    strided = (_StridedShard(0, split_factor=2), TorchShard(0))
    assert placements["layers.0.attn.q_proj.weight"] == strided
    assert placements["output.weight"] == strided
    assert placements["layers.0.attn.o_proj.weight"] == (TorchShard(0), TorchShard(1))
    assert placements["norm.weight"] == (TorchShard(0), TorchReplicate())
    # Before training the state dict is the single-device model bit for bit; after one AdamW
    # step equal to rounding (1e-4 of each tensor's largest entry, as in test_fsdp_tp: Adam's
    # first step divides each gradient entry by its magnitude, magnifying rounding of tiny ones).
    assert before["init_error"] == 0.0, before["init_error"]
    assert before["param_error"] < 1e-4, before["param_error"]
    # Loading moves data only: bit-equal.
    assert _max_error(after["params"], before["params"]) == 0.0
    assert _max_error(after["moments"], before["moments"]) == 0.0


@pytest.mark.multiprocess
def test_checkpoint_reshards_from_world_4_to_world_2(tmp_path: Any) -> None:
    paths = {kind: str(tmp_path / kind) for kind in ("fsdp", "hsdp", "fsdp_tp")}
    saved = run_on_ranks(4, _save_run, paths, timeout=120)[0]
    loaded = run_on_ranks(2, _load_run, paths, timeout=120)[0]
    _check_tp(saved.pop("fsdp_tp"), loaded.pop("fsdp_tp"))
    for kind in saved:
        before, after = saved[kind], loaded[kind]
        assert before["placements_ok"], kind
        assert before["shapes_ok"], kind
        # State dicts hold the single-device values: fp32 rounding after 2 AdamW steps.
        assert before["param_error"] < 1e-6, (kind, before["param_error"])
        assert before["moment_error"] < 1e-9, (kind, before["moment_error"])
        assert before["steps"] == [float(SAVED_AFTER)], kind
        assert after["plain_error"] == 0.0, kind
        assert "size mismatch for head.weight" in after["mismatch"], after["mismatch"]
        assert after["same_objects"], kind
        # World 2 resumed from the checkpoint follows the world-4 run: only the order of the
        # gradient reductions differs (fp32 rounding).
        losses = torch.tensor(after["losses"]) - torch.tensor(before["losses"])
        assert losses.abs().max().item() < 1e-6, (kind, before["losses"], after["losses"])
        assert _max_error(after["final"], before["final"]) < 1e-6, kind
