"""HyperParallel's seven quick-start snippets, as written upstream (device type ``"cpu"``), run
on gloo ranks and checked against a single-device run of the same model.

Each rank function below holds one snippet verbatim between ``# --- upstream snippet N`` and
``# --- end`` (only ``device_type`` is ``"cpu"``; snippet 2's ``no_init_parameters`` comes from
``hyper_parallel`` instead of ``mindspore.nn.utils``; snippet 4 calls ``run(x)`` on stage 0 and
``run()`` on the other stages, which have no input), builds the single-device reference from
the same seed, and asserts losses and gradients equal within fp32 rounding
(``rtol=1e-5, atol=1e-6``) on every rank. Worlds: 2 (snippets 1, 3, 5, 6, 7 and the interleaved
pipeline) and 4 (snippets 2 and 4).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel.equivalence import full_value
from hp_testing import run_on_ranks

RTOL, ATOL = 1e-5, 1e-6
TIMEOUT = 240


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got.reshape(want.shape), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


def _whole(t: torch.Tensor, mesh: DeviceMesh, like: torch.Tensor | None = None) -> torch.Tensor:
    """The whole value of a parameter or gradient: a torch DTensor (``fully_shard``'s
    per-parameter layout) gathers itself, anything else goes through ``full_value``."""
    if isinstance(t, TorchDTensor):
        return t.full_tensor().detach()
    return full_value(t, mesh, like=like)


def _grads_match(model: nn.Module, reference: nn.Module, mesh: DeviceMesh, what: str) -> list[str]:
    """Every parameter's whole gradient equals the reference's; the names compared."""
    names = []
    for (name, p), (ref_name, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert p.grad is not None, (what, name)
        assert q.grad is not None, (what, name)
        _assert_close(_whole(p.grad, mesh, like=p), q.grad, f"{what}: grad of {name}")
        names.append(ref_name)
    return names


# --------------------------------------------------------------------------------------------
# 1. fully_shard over a data-parallel mesh
# --------------------------------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _snippet_fully_shard() -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, dp_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _mlp()
    torch.manual_seed(0)
    model = _mlp()
    # --- upstream snippet 1
    from hyper_parallel import fully_shard, init_device_mesh

    mesh = init_device_mesh(device_type="cpu", mesh_shape=(dp_size,), mesh_dim_names=("dp",))
    model = fully_shard(model, mesh=mesh)
    # --- end
    # As upstream and torch FSDP2: DTensors of the global shape, rows sharded over "dp".
    shapes = [(tuple(p.shape), type(p).__name__, str(p.placements)) for p in model.parameters()]  # type: ignore[attr-defined]
    local_numel = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        loss = F.mse_loss(model(x.chunk(dp_size)[rank]), y.chunk(dp_size)[rank])
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        _assert_close(global_loss / dp_size, ref_loss.detach(), f"step {step} loss")
        _grads_match(model, reference, mesh, f"step {step}")
        optimizer.step()
        ref_optimizer.step()
    return {
        "local_numel": local_numel,
        "numel": sum(p.numel() for p in reference.parameters()),
        "shapes": shapes,
    }


@pytest.mark.multiprocess
def test_snippet_1_fully_shard_matches_single_device() -> None:
    want = [
        (tuple(p.shape), "DTensor", "(Shard(dim=0),)") for p in _mlp().parameters()
    ]  # (16, 8), (16,), (4, 16), (4,)
    for result in run_on_ranks(2, _snippet_fully_shard, timeout=TIMEOUT):
        assert result["local_numel"] < result["numel"], result  # sharded, not replicated
        assert result["shapes"] == want, result


# --------------------------------------------------------------------------------------------
# 3. parallelize_module with tensor-parallel styles (a block whose reshapes use -1 heads)
# --------------------------------------------------------------------------------------------

DIM, HEADS, FFN = 16, 4, 24


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head_dim = DIM // HEADS
        q, k, v = (
            proj(x).view(b, s, -1, head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return projected


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        out: torch.Tensor = x + self.mlp(x)
        return out


def _snippet_tensor_parallel() -> None:
    torch.set_num_threads(1)
    rank, tp_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Block()
    # Each rank initializes differently: upstream's src_data_rank=0 makes rank 0's weights the
    # ones every rank shards (the reference is rank 0's model).
    torch.manual_seed(rank)
    model = _Block()
    # --- upstream snippet 3
    from hyper_parallel import (
        ColwiseParallel,
        RowwiseParallel,
        init_device_mesh,
        parallelize_module,
    )

    tp_mesh = init_device_mesh("cpu", (tp_size,), mesh_dim_names=("tp",))

    parallelize_module(
        model,
        tp_mesh,
        {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        },
    )
    # --- end
    assert model.attn.q_proj.weight.shape[0] == DIM // tp_size  # column-sharded
    x = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(1))
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward()
    loss = model(x).pow(2).mean()
    loss.backward()
    _assert_close(loss.detach(), ref_loss.detach(), "loss")
    _grads_match(model, reference, tp_mesh, "tensor parallel")


@pytest.mark.multiprocess
def test_snippet_3_tensor_parallel_styles_match_single_device() -> None:
    run_on_ranks(2, _snippet_tensor_parallel, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# 2. shard_module with a ShardingPlan, deferred initialization, fully_shard on top
# --------------------------------------------------------------------------------------------

IN, OUT, BATCH = 8, 6, 8


class SimpleModel(nn.Module):
    """``input @ weight``: the input's hidden dim and the weight's rows sharded on tp (a
    row-parallel matmul, its output partial on tp until the output plan replicates it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(IN, OUT))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight


def _snippet_shard_module() -> dict[str, Any]:
    torch.set_num_threads(1)
    dp_size, tp_size = 2, 2
    global_x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = SimpleModel()
    ref_loss = (global_x @ reference.weight).pow(2).mean()
    ref_loss.backward()
    torch.manual_seed(0)  # the random state the single-device construction started from
    losses: list[torch.Tensor] = []

    def run_model(x: Any, model: nn.Module) -> None:
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        losses.append(loss.full_tensor().detach())

    rank = dist.get_rank()
    dp, tp = rank // tp_size, rank % tp_size
    local_x = global_x.chunk(dp_size, 0)[dp].chunk(tp_size, 1)[tp].contiguous()
    # --- upstream snippet 2
    from hyper_parallel import (
        DTensor,
        fully_shard,
        init_device_mesh,
        init_parameters,
        no_init_parameters,
        shard_module,
    )
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.core.shard.sharding_plan import ShardingPlan

    # 定义设备网格和 placement
    mesh = init_device_mesh(
        device_type="cpu", mesh_shape=(dp_size, tp_size), mesh_dim_names=("dp", "tp")
    )
    x_placement = (Shard(0), Shard(1))
    w_placement = (Replicate(), Shard(0))
    out_placement = (Shard(0), Replicate())

    # 网络权重延后初始化
    with no_init_parameters():
        model = SimpleModel()

    # 对网络输入/输出/权重做切分配置
    sharding_plan = ShardingPlan(
        input_plan={"input": x_placement},
        output_plan={"output": out_placement},
        plan={"weight": w_placement},
    )
    model = shard_module(model, device_mesh=mesh, sharding_plan=sharding_plan)

    # 可以进一步配置fully_shard
    model = fully_shard(model, mesh=mesh["dp"])

    # 权重分片初始化
    model = init_parameters(model)

    # 执行
    x = DTensor.from_local(local_x, mesh, x_placement)
    run_model(x, model)
    # --- end
    _assert_close(losses[0], ref_loss.detach(), "loss")
    _grads_match(model, reference, mesh, "shard_module")
    (weight,) = model.parameters()
    _assert_close(full_value(weight, mesh), reference.weight.detach(), "initialized weight")
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return {"local_numel": local.numel(), "type": type(weight).__name__}


@pytest.mark.multiprocess
def test_snippet_2_shard_module_matches_single_device() -> None:
    for result in run_on_ranks(4, _snippet_shard_module, timeout=TIMEOUT):
        # tp shards the rows in two, fully_shard the tp shard in two again.
        assert result["local_numel"] == IN * OUT // 4, result


# --------------------------------------------------------------------------------------------
# 4. PipelineStage and a schedule's run (1F1B and GPipe at 4 stages, interleaved 1F1B)
# --------------------------------------------------------------------------------------------

PIPE_DIM, PIPE_STAGES, PIPE_BATCH = 8, 4, 16


class _Layer(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(PIPE_DIM, PIPE_DIM)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.linear(x))
        # Upstream's last stage returns the microbatch's loss.
        return out.pow(2).mean() if self.last else out


def _pipeline_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Layer(last=i == PIPE_STAGES - 1) for i in range(PIPE_STAGES)))


def _reference_pipeline(x: torch.Tensor, micro_batch_num: int) -> tuple[nn.Sequential, list[float]]:
    """The single-device model; its gradients are those of the sum of the microbatch losses
    (upstream's seed of ones per microbatch)."""
    reference = _pipeline_model()
    losses = [reference(mb) for mb in x.chunk(micro_batch_num)]
    torch.stack(losses).sum().backward()
    return reference, [loss.item() for loss in losses]


def _check_stages(
    stages: list[Any], reference: nn.Sequential, losses: list[torch.Tensor], want: list[float]
) -> None:
    for stage in stages:
        mine, theirs = stage.submodule, reference[stage.stage_index]
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters(), strict=True):
            assert p.grad is not None
            assert q.grad is not None
            _assert_close(p.grad, q.grad, f"stage {stage.stage_index} grad of {name}")
    if any(stage.is_last_stage for stage in stages):
        _assert_close(torch.stack(losses), torch.tensor(want), "microbatch losses")
    else:
        assert losses == [], losses


def _snippet_pipeline() -> list[str]:
    torch.set_num_threads(1)
    stage_index = dist.get_rank()
    split_model = _pipeline_model()[stage_index]
    local_x = torch.randn(PIPE_BATCH, PIPE_DIM, generator=torch.Generator().manual_seed(1))
    reference, want = _reference_pipeline(local_x, 8)
    from hyper_parallel import DTensor, Replicate, init_device_mesh

    input_mesh = init_device_mesh("cpu", (PIPE_STAGES,), mesh_dim_names=("pp",))
    input_placements = (Replicate(),)
    # --- upstream snippet 4
    from hyper_parallel.core.pipeline_parallel import PipelineStage, Schedule1F1B

    # 将切分后的module封装成PipelineStage
    stage = PipelineStage(split_model, stage_index, stage_num=4)

    # 选择流水线并行的调度
    schedule = Schedule1F1B(stage, micro_batch_num=8)

    # 执行
    if stage_index == 0:
        x = DTensor.from_local(local_x, input_mesh, input_placements)
        losses = schedule.run(x)
    else:
        losses = schedule.run()
    # --- end
    _check_stages([stage], reference, losses, want)
    checked = ["Schedule1F1B"]
    from hyper_parallel import ScheduleGPipe

    split_model.zero_grad()
    gpipe = ScheduleGPipe(stage, micro_batch_num=8)
    losses = gpipe.run(local_x) if stage_index == 0 else gpipe.run()
    _check_stages([stage], reference, losses, want)
    return [*checked, "ScheduleGPipe"]


def _snippet_interleaved() -> None:
    torch.set_num_threads(1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    model = _pipeline_model()
    local_x = torch.randn(PIPE_BATCH, PIPE_DIM, generator=torch.Generator().manual_seed(1))
    reference, want = _reference_pipeline(local_x, 4)
    from hyper_parallel import PipelineStage, ScheduleInterleaved1F1B

    stages = [
        PipelineStage(model[index], index, stage_num=PIPE_STAGES)
        for index in range(rank, PIPE_STAGES, ranks)
    ]
    schedule = ScheduleInterleaved1F1B(stages, micro_batch_num=4)
    losses = schedule.run(local_x) if rank == 0 else schedule.run()
    _check_stages(stages, reference, losses, want)


@pytest.mark.multiprocess
def test_snippet_4_pipeline_schedules_match_single_device() -> None:
    for checked in run_on_ranks(4, _snippet_pipeline, timeout=TIMEOUT):
        assert checked == ["Schedule1F1B", "ScheduleGPipe"]


@pytest.mark.multiprocess
def test_interleaved_1f1b_two_stages_per_rank_matches_single_device() -> None:
    run_on_ranks(2, _snippet_interleaved, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# 5. get_hyper_optimizer: Muon + AdamW chained, on a fully sharded model
# --------------------------------------------------------------------------------------------


def _optimizer_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _groups(model: nn.Module) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    named = list(model.named_parameters())
    muon = [{"params": [p for n, p in named if n.endswith("weight")]}]
    adamw = [{"params": [p for n, p in named if not n.endswith("weight")]}]
    return muon, adamw


def _snippet_optimizer() -> None:
    torch.set_num_threads(1)
    from hp_muon import ChainedOptimizer, Muon
    from hyper_parallel import fully_shard, init_device_mesh

    # The single-device reference: upstream's Muon numerics spelled out in hp-muon's terms
    # (its 5 coefficient triples, lr scaled by 0.2 sqrt(max(rows, cols))) and AdamW.
    reference = _optimizer_model()
    ref_muon, ref_adamw = _groups(reference)
    ref_optimizer = ChainedOptimizer(
        [
            torch.optim.AdamW(ref_adamw, lr=3e-4, weight_decay=0.1),
            Muon(
                ref_muon,
                lr=0.02,
                momentum=0.95,
                weight_decay=0.1,
                ns_coefficients="you_5step",
                adjust_lr_fn="match_rms_adamw",
            ),
        ]
    )
    model = _optimizer_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    muon_param_groups, adamw_param_groups = _groups(model)
    # --- upstream snippet 5
    from hyper_parallel.core.optimizer import get_hyper_optimizer

    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=muon_param_groups,
        adamw_params=adamw_param_groups,
        muon_kwargs={"lr": 0.02, "momentum": 0.95},
        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
    )
    # --- end
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        # Every rank takes the whole batch: the averaged gradient is then bit-equal to the
        # single-device one, so the optimizers' inputs agree exactly.
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 4, generator=g)
        for opt, net in ((optimizer, model), (ref_optimizer, reference)):
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            if net is model:
                got = loss.detach()
            else:
                _assert_close(got, loss.detach(), f"step {step} loss")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        _assert_close(_whole(p, mesh), q.detach(), f"{name} after 3 steps")


@pytest.mark.multiprocess
def test_snippet_5_get_hyper_optimizer_matches_single_device() -> None:
    run_on_ranks(2, _snippet_optimizer, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------------
# 6. checkpoint_wrapper / swap_wrapper on layers, then fully_shard
# --------------------------------------------------------------------------------------------

WIDE = 1024  # layer 1's activations: 32 rows x 1024 fp32 = 128 KiB > the swapper's 64 KiB


class _Counted(nn.Module):
    """Linear, GELU, Linear; counts its forward calls (a recomputation calls it again)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, WIDE)
        self.down = nn.Linear(WIDE, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = x + self.down(F.gelu(self.up(x)))
        return out


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Counted(), _Counted()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _snippet_activation() -> dict[str, int]:
    torch.set_num_threads(1)
    from hp_offload import ActivationMeter
    from hyper_parallel import fully_shard, init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _Layers()
    model = _Layers()
    # --- upstream snippet 6
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap_wrapper

    model.layers[0] = checkpoint_wrapper(model.layers[0])
    model.layers[1] = swap_wrapper(model.layers[1])
    # --- end
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(32 * world, 16, generator=torch.Generator().manual_seed(1))
    ref_loss = reference(x).pow(2).mean()
    ref_loss.backward()
    # The meter excludes storages: a DTensor parameter's is its local tensor's.
    local_params = [p.to_local() if isinstance(p, TorchDTensor) else p for p in model.parameters()]
    with ActivationMeter(exclude=local_params) as meter:
        loss = model(x.chunk(world)[rank]).pow(2).mean()
        loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    _assert_close(global_loss / world, ref_loss.detach(), "loss")
    _grads_match(model, reference, mesh, "checkpoint and swap")
    layers: Any = model.layers
    return {"calls0": layers[0].calls, "calls1": layers[1].calls, "host": meter.peak_host}


@pytest.mark.multiprocess
def test_snippet_6_checkpoint_and_swap_wrappers_match_single_device() -> None:
    for result in run_on_ranks(2, _snippet_activation, timeout=TIMEOUT):
        assert result["calls0"] == 2, result  # layer 0 ran again in backward (checkpointed)
        assert result["calls1"] == 1, result  # layer 1 kept its activations ...
        assert result["host"] >= 32 * WIDE * 4, result  # ... in host memory (swapped)


# --------------------------------------------------------------------------------------------
# 7. The multicore MoE overlap operator: named, not offered; what exists instead runs
# --------------------------------------------------------------------------------------------


def _fused_matmuls() -> None:
    torch.set_num_threads(1)
    from hp_kernels import all_gather_matmul, matmul_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4 * world, 6, generator=g), torch.randn(6, 5, generator=g)
    _assert_close(all_gather_matmul(a.chunk(world)[rank], b), a @ b, "all_gather_matmul")
    got = matmul_reduce_scatter(a.chunk(world, 1)[rank], b.chunk(world, 0)[rank])
    _assert_close(got, (a @ b).chunk(world)[rank], "matmul_reduce_scatter")


def test_snippet_7_moe_overlap_operator_names_what_exists() -> None:
    from hyper_parallel import MegaMoeExperts, NotOfferedError
    from hyper_parallel.core.multicore import MegaMoeExperts as UpstreamPath

    assert UpstreamPath is MegaMoeExperts
    with pytest.raises(NotOfferedError) as caught:
        MegaMoeExperts(num_experts=8)
    message = str(caught.value)
    assert "hp_kernels.all_gather_matmul" in message
    assert "hp_kernels.matmul_reduce_scatter" in message


@pytest.mark.multiprocess
def test_snippet_7_fused_matmuls_named_instead_match_single_device() -> None:
    run_on_ranks(2, _fused_matmuls, timeout=TIMEOUT)
