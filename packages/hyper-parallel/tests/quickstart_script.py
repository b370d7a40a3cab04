"""The quick start against an installed ``hyper-parallel`` (no test helpers): nox's
``build-all`` runs it with ``python`` of a fresh venv where ``pip install hyper-parallel`` came
from the built wheels alone.

One process, world 1 (gloo, a free local port): every quick-start import path is imported, and
snippets 1 (fully_shard), 2 (shard_module, deferred init), 3 (TP styles), 4 (Schedule1F1B), 5
(get_hyper_optimizer) and 6 (checkpoint/swap wrappers) each run one step on a tiny model and
are compared with the same model without hyper_parallel (fp32, ``rtol=1e-5, atol=1e-6``).
Snippet 7 must refuse. Prints one line per snippet; exits non-zero on the first mismatch.

Run: ``python packages/hyper-parallel/tests/quickstart_script.py``.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

RTOL, ATOL = 1e-5, 1e-6


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got.reshape(want.shape), want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}"
    )


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A torch DTensor's (fully_shard's parameters and gradients) whole value; else ``t``."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [_whole(p.grad).reshape(-1) for p in model.parameters() if p.grad is not None]


def _compare(model: nn.Module, reference: nn.Module, x: torch.Tensor, what: str) -> None:
    _close(_step(model, x), _step(reference, x), f"{what} loss")
    got, want = _grads(model), _grads(reference)
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _close(g, w, f"{what} grad {i}")


def snippet_fully_shard(x: torch.Tensor) -> None:
    from hyper_parallel import fully_shard, init_device_mesh

    model = _mlp()
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(1,), mesh_dim_names=("dp",))
    model = fully_shard(model, mesh=mesh)
    # As upstream: parameters of their global shape (hp-fsdp's per-parameter layout).
    shapes = [tuple(p.shape) for p in model.parameters()]
    if shapes != [tuple(p.shape) for p in _mlp().parameters()]:
        raise AssertionError(f"fully_shard must keep global shapes, got {shapes}")
    _compare(model, _mlp(), x, "fully_shard")


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight


def snippet_shard_module(x: torch.Tensor) -> None:
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

    torch.manual_seed(0)
    reference = SimpleModel()
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(1, 1), mesh_dim_names=("dp", "tp"))
    x_placement = (Shard(0), Shard(1))
    with no_init_parameters():
        model = SimpleModel()
    plan = ShardingPlan(
        input_plan={"input": x_placement},
        output_plan={"output": (Shard(0), Replicate())},
        plan={"weight": (Replicate(), Shard(0))},
    )
    model = shard_module(model, device_mesh=mesh, sharding_plan=plan)
    model = fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(0)
    model = init_parameters(model)
    loss = model(DTensor.from_local(x, mesh, x_placement)).pow(2).mean()
    loss.backward()
    _close(loss.full_tensor().detach(), _step(reference, x), "shard_module loss")
    (weight,) = model.parameters()
    assert weight.grad is not None
    assert reference.weight.grad is not None
    grad = weight.grad.full_tensor() if isinstance(weight.grad, DTensor) else weight.grad
    _close(grad, reference.weight.grad, "shard_module grad")


def snippet_tensor_parallel(x: torch.Tensor) -> None:
    from hyper_parallel import (
        ColwiseParallel,
        RowwiseParallel,
        init_device_mesh,
        parallelize_module,
    )

    model = _mlp()
    tp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _compare(model, _mlp(), x, "parallelize_module")


class _LastStage(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x).pow(2).mean()
        return out


def snippet_pipeline(x: torch.Tensor) -> None:
    from hyper_parallel.core.pipeline_parallel import PipelineStage, Schedule1F1B

    stage = PipelineStage(_LastStage(_mlp()), 0, stage_num=1)
    schedule = Schedule1F1B(stage, micro_batch_num=2)
    losses = schedule.run(x)
    reference = _mlp()
    want = [reference(mb).pow(2).mean() for mb in x.chunk(2)]
    torch.stack(want).sum().backward()
    _close(torch.stack(losses), torch.stack(want).detach(), "Schedule1F1B losses")
    for i, (g, w) in enumerate(zip(_grads(stage.submodule), _grads(reference), strict=True)):
        _close(g, w, f"Schedule1F1B grad {i}")


def snippet_optimizer(x: torch.Tensor) -> None:
    from hp_muon import ChainedOptimizer, Muon
    from hyper_parallel.core.optimizer import get_hyper_optimizer

    def groups(net: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        named = list(net.named_parameters())
        return [p for n, p in named if n.endswith("weight")], [
            p for n, p in named if n.endswith("bias")
        ]

    model, reference = _mlp(), _mlp()
    muon_params, adamw_params = groups(model)
    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=[{"params": muon_params}],
        adamw_params=[{"params": adamw_params}],
        muon_kwargs={"lr": 0.02, "momentum": 0.95},
        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
    )
    ref_muon, ref_adamw = groups(reference)
    ref_optimizer = ChainedOptimizer(
        [
            torch.optim.AdamW(ref_adamw, lr=3e-4, weight_decay=0.1),
            Muon(ref_muon, lr=0.02, ns_coefficients="you_5step", adjust_lr_fn="match_rms_adamw"),
        ]
    )
    for opt, net in ((optimizer, model), (ref_optimizer, reference)):
        _step(net, x)
        opt.step()
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters(), strict=True)):
        _close(p.detach(), q.detach(), f"get_hyper_optimizer param {i}")


def snippet_activation(x: torch.Tensor) -> None:
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap_wrapper

    model = _mlp()
    model[0] = checkpoint_wrapper(model[0])
    model[2] = swap_wrapper(model[2])
    _compare(model, _mlp(), x, "checkpoint/swap wrappers")


def snippet_moe(x: torch.Tensor) -> None:
    from hyper_parallel import NotOfferedError
    from hyper_parallel.core.multicore import MegaMoeExperts

    del x
    message = ""
    try:
        MegaMoeExperts()
    except NotOfferedError as exc:
        message = str(exc)
    if "hp_kernels.all_gather_matmul" not in message:
        raise AssertionError(f"MegaMoeExperts must refuse naming what exists, got {message!r}")


SNIPPETS: tuple[Callable[[torch.Tensor], None], ...] = (
    snippet_fully_shard,
    snippet_shard_module,
    snippet_tensor_parallel,
    snippet_pipeline,
    snippet_optimizer,
    snippet_activation,
    snippet_moe,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    import hyper_parallel

    torch.set_num_threads(1)
    where = Path(hyper_parallel.__file__).parent
    print(f"hyper_parallel {hyper_parallel.__version__} from {where}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo")
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        for snippet in SNIPPETS:
            snippet(x)
            print(f"ok: {snippet.__name__}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
