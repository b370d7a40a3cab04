"""Production-mode tensor parallelism gives the single-device gradient however the caller forms
the loss, side by side with ``torch.distributed.tensor.parallel`` on the same calls.

The call paths (``hp_testing.call_paths``): the root's output, a chain of submodules the
caller runs itself, a loss term on an intermediate block output, two forwards in one
backward, a penalty on replicated parameters, two backward passes into one gradient, and
activation checkpointing (non-reentrant and reentrant) inside the model and around the
caller's own block calls. Every gradient is compared with one device (fp32: within 1e-5 of
each tensor's largest entry, the issue's bound); torch's tensor parallelism runs the same
calls on the same model and must agree with one device too (it is the oracle that the path
is meaningful, and the peer hp is measured against). Also the Hugging Face Llama
(``model.model`` then ``lm_head``, the chunked-loss path; hidden states the model returns)
and a mixture-of-experts model under expert parallelism.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import (
    ColwiseParallel,
    ExpertParallel,
    PlanError,
    PrepareModuleInput,
    RowwiseParallel,
    context_parallel_cross_entropy,
    local_positions,
    parallelize_module,
    shard_sequence,
    transformer_tp_plan,
)
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh, Replicate
from hp_testing import run_on_ranks
from hp_testing.call_paths import PATHS, checkpointed_blocks, worst_gradient_error
from hp_testing.llama import Llama, LlamaConfig
from hp_testing.moe import MoE

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
BOUND = 1e-5  # fp32, relative to each gradient's largest entry

# Under sequence parallelism a plain-tensor statistic of an intermediate activation (its mean)
# is a statistic of the rank's sequence shard: a loss the caller computes differently, not a
# call path (torch computes it on the shard too).
SP_PATHS = [p for p in PATHS if p != "intermediate"]


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
    return ids, torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)


def _torch_tp(model: nn.Module, world: int, sequence_parallel: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import PrepareModuleInput as TorchPrepareInput
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import SequenceParallel as TorchSequenceParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    between = TorchShard(1) if sequence_parallel else TorchReplicate()
    plan: dict[str, Any] = {
        "tok_embeddings": TorchRowwise(input_layouts=TorchReplicate(), output_layouts=between),
        "layers.*.attn.q_proj": TorchColwise(),
        "layers.*.attn.k_proj": TorchColwise(),
        "layers.*.attn.v_proj": TorchColwise(),
        "layers.*.attn.o_proj": TorchRowwise(output_layouts=between),
        "layers.*.ffn.w1": TorchColwise(),
        "layers.*.ffn.w3": TorchColwise(),
        "layers.*.ffn.w2": TorchRowwise(output_layouts=between),
        "output": TorchColwise(input_layouts=between, output_layouts=TorchReplicate()),
    }
    if sequence_parallel:
        for name in ("layers.*.attn_norm", "layers.*.ffn_norm", "norm"):
            plan[name] = TorchSequenceParallel()
        plan["layers.*.attn"] = TorchPrepareInput(
            input_layouts=(TorchShard(1), None, None),
            desired_input_layouts=(TorchReplicate(), None, None),
        )
        plan["layers.*.ffn"] = TorchPrepareInput(
            input_layouts=(TorchShard(1),), desired_input_layouts=(TorchReplicate(),)
        )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return torch_parallelize(model, mesh, plan)


def _torch_grad(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor as TorchDTensor

    assert p.grad is not None
    grad = p.grad
    return grad.full_tensor() if isinstance(grad, TorchDTensor) else grad


def _sharded(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """A production parameter's whole gradient (gathered over ``mesh``)."""

    def whole(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None
        return full_value(p.grad, mesh, like=p)

    return whole


def _run_paths(
    paths: list[str], models: dict[str, nn.Module], grads: dict[str, Any]
) -> dict[str, dict[str, tuple[float, str]]]:
    reference = models["reference"]
    out: dict[str, dict[str, tuple[float, str]]] = {}
    for i, path in enumerate(paths):
        ids, targets = _batch(i)
        for model in models.values():
            model.zero_grad(set_to_none=True)
            for loss in PATHS[path](model, ids, targets):
                loss.backward()
        out[path] = {
            name: worst_gradient_error(model, reference, grads[name])
            for name, model in models.items()
            if name != "reference"
        }
    return out


def _dense(plan_name: str, paths: list[str]) -> dict[str, dict[str, tuple[float, str]]]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    sequence_parallel = plan_name == "sp"
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    hp = Llama(CONFIG)
    hp.load_state_dict(reference.state_dict())
    torch_model = Llama(CONFIG)
    torch_model.load_state_dict(reference.state_dict())
    mesh = DeviceMesh("cpu", Mesh((world,), ("tp",)))
    parallelize_module(hp, mesh, transformer_tp_plan(sequence_parallel=sequence_parallel))
    _torch_tp(torch_model, world, sequence_parallel)

    hp_grad = _sharded(mesh)
    return _run_paths(
        paths,
        {"reference": reference, "hp": hp, "torch": torch_model},
        {"hp": hp_grad, "torch": _torch_grad},
    )


def _check(results: list[dict[str, dict[str, tuple[float, str]]]]) -> None:
    for per_rank in results:
        for path, errors in per_rank.items():
            for who, (err, name) in errors.items():
                assert err < BOUND, f"{who} on path {path!r}: {name} off by {err:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("plan_name", "world"), [("tp", 2), ("sp", 2), ("tp", 4)], ids=["tp2", "sp2", "tp4"]
)
def test_every_call_path_gives_the_single_device_gradient(plan_name: str, world: int) -> None:
    paths = SP_PATHS if plan_name == "sp" else list(PATHS)
    _check(run_on_ranks(world, _dense, plan_name, paths, timeout=300))


# The MLP: the caller runs a column-parallel and a row-parallel Linear itself ---------


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.relu(self.up(self.norm(x))))
        return out


def _mlp_paths() -> dict[str, Callable[[Any, torch.Tensor], list[torch.Tensor]]]:
    def root(m: Any, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x).pow(2).sum()]

    def by_caller(m: Any, x: torch.Tensor) -> list[torch.Tensor]:
        return [m.down(F.relu(m.up(m.norm(x)))).pow(2).sum()]

    def penalty(m: Any, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x).pow(2).sum() + m.norm.weight.pow(2).sum()]

    def twice(m: Any, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x).pow(2).sum() + m(2 * x).sum()]

    def accumulate(m: Any, x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x[:2]).pow(2).sum(), m(x[2:]).pow(2).sum()]

    return {
        "root": root,
        "by_caller": by_caller,
        "penalty": penalty,
        "twice": twice,
        "accumulate": accumulate,
    }


def _mlp(paths: list[str]) -> dict[str, dict[str, tuple[float, str]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(0)
    reference, hp, torch_model = _MLP(), _MLP(), _MLP()
    hp.load_state_dict(reference.state_dict())
    torch_model.load_state_dict(reference.state_dict())
    mesh = DeviceMesh("cpu", Mesh((world,), ("tp",)))
    parallelize_module(hp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    torch_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch_parallelize(torch_model, torch_mesh, {"up": TorchColwise(), "down": TorchRowwise()})

    hp_grad = _sharded(mesh)
    models: dict[str, nn.Module] = {"reference": reference, "hp": hp, "torch": torch_model}
    grads = {"hp": hp_grad, "torch": _torch_grad}
    out: dict[str, dict[str, tuple[float, str]]] = {}
    for i, path in enumerate(paths):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        for model in models.values():
            model.zero_grad(set_to_none=True)
            for loss in _mlp_paths()[path](model, x):
                loss.backward()
        out[path] = {
            name: worst_gradient_error(models[name], reference, grads[name])
            for name in ("hp", "torch")
        }
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_mlp_called_any_way_gives_the_single_device_gradient(world: int) -> None:
    _check(run_on_ranks(world, _mlp, list(_mlp_paths()), timeout=300))


# Hugging Face Llama: the caller's own head call, hidden states the model returns ------------


def _hf_paths() -> dict[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]]:
    def root(m: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = m(input_ids=ids, labels=labels, use_cache=False).loss
        return loss

    def head_by_caller(m: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # What chunked or fused cross-entropy does: the body, then the head on the states.
        h = m.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = m.lm_head(h)
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )

    def hidden_states(m: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = m(input_ids=ids, labels=labels, use_cache=False, output_hidden_states=True)
        loss: torch.Tensor = out.loss + 0.05 * out.hidden_states[1].pow(2).mean()
        return loss

    def penalty(m: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = root(m, ids, labels)
        weight: torch.Tensor = m.model.norm.weight
        return loss + 0.1 * (weight - 0.5).pow(2).sum()

    return {
        "root": root,
        "head_by_caller": head_by_caller,
        "hidden_states": hidden_states,
        "penalty": penalty,
    }


def _hf(paths: list[str]) -> dict[str, tuple[float, str]]:
    from hp_testing.hf import VOCAB, causal_lm, tp_plan_styles

    torch.set_num_threads(1)
    world = dist.get_world_size()
    reference, model = causal_lm("llama"), causal_lm("llama")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[kind]() for name, kind in tp_plan_styles("llama").items()}
    # World 4: two data-parallel replicas of tp 2 (its two key/value heads split no further),
    # each on half the batch; the plan averages gradients over dp.
    dp = world // 2
    mesh = DeviceMesh("cpu", Mesh((dp, 2), ("dp", "tp")))
    parallelize_module(model, mesh, plan, tp_axis="tp")
    replica = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(5)
    out: dict[str, tuple[float, str]] = {}
    for path in paths:
        ids = torch.randint(0, VOCAB, (2 * dp, 8), generator=g)
        mine = ids.chunk(dp)[replica]
        for m, batch in ((reference, ids), (model, mine)):
            m.zero_grad(set_to_none=True)
            _hf_paths()[path](m, batch, batch).backward()
        out[path] = worst_gradient_error(model, reference, _sharded(mesh))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_hugging_face_llama_call_paths_give_the_single_device_gradient(world: int) -> None:
    for per_rank in run_on_ranks(world, _hf, list(_hf_paths()), timeout=300):
        for path, (err, name) in per_rank.items():
            assert err < BOUND, f"path {path!r}: {name} off by {err:.2e}"


# Expert parallelism with the whole batch on every rank: one loss, the region's edge ---------


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.moe = MoE(8, 12, num_experts=4, top_k=2)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        out: torch.Tensor = self.head(h + self.moe(h))
        return out


def _moe_paths() -> dict[str, Callable[[_MoEModel, torch.Tensor, torch.Tensor], torch.Tensor]]:
    def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))

    def root(m: _MoEModel, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ce(m(ids), t)

    def chain(m: _MoEModel, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = m.embed(ids)
        return ce(m.head(h + m.moe(h)), t)

    def penalty(m: _MoEModel, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return root(m, ids, t) + 0.1 * m.moe.router.weight.pow(2).sum()

    def twice(m: _MoEModel, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return root(m, ids, t) + 0.5 * root(m, ids.flip(1), t)

    return {"root": root, "chain": chain, "penalty": penalty, "twice": twice}


def _moe(paths: list[str]) -> dict[str, tuple[float, str]]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(0)
    reference = _MoEModel()
    model = _MoEModel()
    model.load_state_dict(reference.state_dict())
    mesh = DeviceMesh("cpu", Mesh((world,), ("ep",)))
    plan = {
        "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "moe": ExpertParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)
    g = torch.Generator().manual_seed(9)
    out: dict[str, tuple[float, str]] = {}
    for path in paths:
        ids = torch.randint(0, 16, (4, 3), generator=g)
        targets = torch.randint(0, 16, (4, 3), generator=g)
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            _moe_paths()[path](m, ids, targets).backward()
        out[path] = worst_gradient_error(model, reference, _sharded(mesh))
    return out


@pytest.mark.multiprocess
def test_expert_parallel_call_paths_give_the_single_device_gradient() -> None:
    for per_rank in run_on_ranks(2, _moe, list(_moe_paths()), timeout=300):
        for path, (err, name) in per_rank.items():
            assert err < BOUND, f"path {path!r}: {name} off by {err:.2e}"


# Context parallelism: the sequence sharded over cp, one loss on every rank ------------------


def _cp_paths() -> dict[str, Callable[[Any, Any, torch.Tensor, torch.Tensor], list[torch.Tensor]]]:
    """Each path gets the model, a loss ``(model, ids, targets) -> loss`` (the whole sequence
    on one device; the rank's zigzag piece under CP), ids and targets."""

    def root(m: Any, loss: Any, ids: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
        return [loss(m, ids, t)]

    def penalty(m: Any, loss: Any, ids: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
        weight: torch.Tensor = m.norm.weight
        return [loss(m, ids, t) + 0.1 * (weight - 0.5).pow(2).sum()]

    def twice(m: Any, loss: Any, ids: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
        return [loss(m, ids, t) + 0.5 * loss(m, ids.flip(0), t)]

    def accumulate(m: Any, loss: Any, ids: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
        return [0.5 * loss(m, ids[:1], t[:1]), 0.5 * loss(m, ids[1:], t[1:])]

    def checkpointed(reentrant: bool) -> Any:
        def path(m: Any, loss: Any, ids: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
            with checkpointed_blocks(m, use_reentrant=reentrant):
                return [loss(m, ids, t)]

        return path

    return {
        "root": root,
        "penalty": penalty,
        "twice": twice,
        "accumulate": accumulate,
        "checkpoint": checkpointed(False),
        "checkpoint_reentrant": checkpointed(True),
    }


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _cp(variant: str, paths: list[str]) -> dict[str, tuple[float, str]]:
    from test_parallel_context import SEQ, VOCAB, _cp_plan, _Model

    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("cp",)))
    torch.manual_seed(0)
    reference = _Model()
    model = _Model()
    model.load_state_dict(reference.state_dict())
    parallelize_module(model, mesh, _cp_plan(variant), tp_axis="cp")
    positions = local_positions(SEQ, mesh, "cp")

    def whole_loss(m: Any, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = m(ids, torch.arange(SEQ))
        return F.cross_entropy(logits.reshape(-1, VOCAB), t.reshape(-1))

    def cp_loss(m: Any, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = m(shard_sequence(ids, 1, mesh, "cp"), positions)
        return context_parallel_cross_entropy(logits, shard_sequence(t, 1, mesh, "cp"), mesh, "cp")

    g = torch.Generator().manual_seed(4)
    out: dict[str, tuple[float, str]] = {}
    for path in paths:
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        for m, loss in ((reference, whole_loss), (model, cp_loss)):
            m.zero_grad(set_to_none=True)
            for value in _cp_paths()[path](m, loss, ids, targets):
                value.backward()
        out[path] = worst_gradient_error(model, reference, _grad)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_context_parallel_call_paths_give_the_single_device_gradient(variant: str) -> None:
    for per_rank in run_on_ranks(2, _cp, variant, list(_cp_paths()), timeout=300):
        for path, (err, name) in per_rank.items():
            assert err < BOUND, f"{variant}, path {path!r}: {name} off by {err:.2e}"


def _cp_chain_by_caller() -> str:
    from test_parallel_context import SEQ, VOCAB, _cp_plan, _Model

    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("cp",)))
    model: Any = parallelize_module(_Model(), mesh, _cp_plan("ring"), tp_axis="cp")
    ids = shard_sequence(torch.randint(0, VOCAB, (2, SEQ)), 1, mesh, "cp")
    try:
        model.emb(ids)
    except PlanError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_context_parallel_refuses_a_chain_whose_placements_it_cannot_tell() -> None:
    # The embedding's output is a sequence shard, which nothing in the plan records: calling it
    # outside the root is refused rather than given a replicated value's gradient.
    for message in run_on_ranks(2, _cp_chain_by_caller, timeout=120):
        assert "the output of emb" in message, message
        assert "PrepareModuleInputOutput" in message, message


# What cannot be told apart is refused, naming the module -------------------------------------


def _unknown_placement_under_sequence_parallelism() -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    plan = transformer_tp_plan(sequence_parallel=True)
    del plan["layers.*"]  # the blocks' placements left unrecorded
    parallelize_module(model, mesh, plan)
    ids, _ = _batch(0)
    seq = ids.shape[1]
    # The caller's own tensor (computed from the model's output, so its placement is not
    # recorded) handed to a block: a sequence shard or a replicated value?
    x = model.tok_embeddings(ids) * 1.0
    try:
        model.layers[1](x, model.cos[:seq], model.sin[:seq])
    except PlanError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_an_unknown_placement_under_sequence_parallelism_is_refused() -> None:
    for message in run_on_ranks(2, _unknown_placement_under_sequence_parallelism, timeout=120):
        assert "no known placement" in message, message
        assert "layers.1" in message, message


def _copied() -> list[str]:
    torch.set_num_threads(1)
    model = _MLP()
    parallelize_module(model, DeviceMesh("cpu", Mesh((2,), ("tp",))), {"up": ColwiseParallel()})
    messages = []
    for copy_ in (copy.deepcopy, pickle.dumps):
        try:
            copy_(model)
        except (TypeError, AttributeError) as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.multiprocess
def test_a_production_model_refuses_to_be_copied_or_pickled() -> None:
    # A copy would share the original's hooks and lose its parameters' layouts: wrong gradients
    # with no error. Refused, saying what to do instead (pickling fails on the hooks already).
    for messages in run_on_ranks(2, _copied, timeout=60):
        assert len(messages) == 2, messages
        assert "cannot be copied" in messages[0], messages
        assert "state_dict()" in messages[0], messages
