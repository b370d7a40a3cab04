"""torch's tensor-parallel behaviours, run on ``torch.distributed.tensor.parallel`` and on
``hp_dtensor.parallel`` side by side (production mode, torch's own mesh and placements).

Each case builds one module, parallelizes a copy with torch's ``parallelize_module`` and a copy
with ours (given torch's ``DeviceMesh`` and torch's placements, a bare style as the plan, as a
torch user writes it), feeds both the same inputs and compares what torch's own tests check:
local output shapes and values, gradients, and the collectives torch's ``CommDebugMode`` counts
(by its keys, ``c10d_functional.*``). Where hp differs on purpose (its gradient convention adds
a reduction in backward; production mode hands on plain local tensors), the test asserts hp's
documented behaviour next to torch's, so a change on either side shows. Oracles: torch's
implementation on the same data, and the one-device module.

World 2 (the persistent gloo rank pool). The README's table of torch behaviours points here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor import parallel as torch_tp
from torch.distributed.tensor.debug import CommDebugMode

from hp_dtensor import DeviceMesh
from hp_dtensor import parallel as hp_tp
from hp_dtensor.interop import InteropError
from hp_dtensor.parallel.plan import PlanError, PlanLayoutLengthError
from hp_layout import Replicate, Shard
from hp_testing import run_on_ranks

WORLD = 2
Counts = dict[str, int]


def _names(mode: CommDebugMode) -> Counts:
    return {str(op): n for op, n in mode.get_comm_counts().items() if n}


def _run(
    module: nn.Module, call: Callable[[nn.Module], torch.Tensor], warm: bool
) -> tuple[torch.Tensor, Counts, Counts]:
    """Forward and ``sum().backward()`` under CommDebugMode: output, forward and backward
    counts. ``warm``: one untimed call first (hp learns a sharded input's global extent on the
    first call of each local shape, with one tiny all-gather that torch does not need)."""
    if warm:
        call(module).sum().backward()
        module.zero_grad()
    mode = CommDebugMode()
    with mode:
        out = call(module)
        forward = _names(mode)
    with CommDebugMode() as mode:
        out.sum().backward()
        backward = _names(mode)
    return out, forward, backward


def _caller(x: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    return lambda module: module(x)


TP_APIS: tuple[tuple[str, Any], ...] = (("hp", hp_tp), ("torch", torch_tp))
"""The two libraries under one name each: same calls, torch's placements."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, TorchDTensor) else t


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as the whole tensor's local piece (a torch Partial gradient is
    reduced first, as the optimizer step would see it summed)."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if isinstance(g, TorchDTensor):
            # The whole gradient (Partial ones reduced), then the piece the parameter holds.
            whole = g.full_tensor()
            assert isinstance(p, TorchDTensor)
            (placement,) = p.placements
            if isinstance(placement, TorchShard):
                whole = whole.chunk(WORLD, dim=placement.dim)[dist.get_rank()]
            g = whole
        out[name] = g.detach().clone()
    return out


def _linear(input_features: int = 16) -> nn.Linear:
    torch.manual_seed(1)
    layer = nn.Linear(input_features, 16)
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)  # non-zero: a bias reduced twice or never shows
    return layer


def _case_colwise() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _linear()
    ours = hp_tp.parallelize_module(copy.deepcopy(model), mesh, hp_tp.ColwiseParallel())
    theirs = torch_tp.parallelize_module(copy.deepcopy(model), mesh, torch_tp.ColwiseParallel())
    torch.manual_seed(2)
    x = torch.rand(8, 16)
    results = {}
    for label, module in (("hp", ours), ("torch", theirs)):
        xi = x.clone().requires_grad_()
        out, fwd, bwd = _run(module, _caller(xi), warm=False)
        assert xi.grad is not None
        results[label] = (out.detach(), fwd, bwd, _grads(module), xi.grad.clone())
    return results


def _case_colwise_sharded_input() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _linear()
    results = {}
    torch.manual_seed(3 + dist.get_rank())  # each rank its own batch rows
    x = torch.rand(8, 16)
    for label, tp in TP_APIS:
        module = tp.parallelize_module(
            copy.deepcopy(model), mesh, tp.ColwiseParallel(input_layouts=TorchShard(0))
        )
        xi = x.clone().requires_grad_()
        out, fwd, bwd = _run(module, _caller(xi), warm=True)
        results[label] = (out.detach(), fwd, bwd, _grads(module))
    return results


def _case_rowwise(output_layout: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _linear()
    torch.manual_seed(4 + dist.get_rank())  # this rank's input features
    x = torch.rand(8, 16 // WORLD)
    results = {}
    for label, tp in TP_APIS:
        module = tp.parallelize_module(
            copy.deepcopy(model), mesh, tp.RowwiseParallel(output_layouts=output_layout)
        )
        xi = x.clone().requires_grad_()
        out, fwd, bwd = _run(module, _caller(xi), warm=output_layout is not None)
        results[label] = (_local(out).detach(), fwd, bwd, _grads(module))
    return results


def _case_embedding() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(5)
    model = nn.Embedding(16, 16)
    ids = torch.arange(8).reshape(4, 2)
    results = {}
    for label, tp in TP_APIS:
        cases = (
            ("colwise", tp.ColwiseParallel()),
            ("rowwise", tp.RowwiseParallel(input_layouts=TorchReplicate())),
        )
        for kind, style in cases:
            module = tp.parallelize_module(copy.deepcopy(model), mesh, style)
            out, fwd, bwd = _run(module, lambda m: m(ids), warm=False)
            results[f"{label}-{kind}"] = (_local(out).detach(), fwd, bwd, _grads(module))
    return results


def _case_requires_grad() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for label, tp in TP_APIS:
        for kind, style in (("col", tp.ColwiseParallel()), ("row", tp.RowwiseParallel())):
            model = _linear()
            model.weight.requires_grad_(False)
            module = tp.parallelize_module(model, mesh, style)
            results[f"{label}-{kind}"] = (module.weight.requires_grad, module.bias.requires_grad)
    return results


def _case_prepare() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    piece = torch.arange(32.0).reshape(2, 16) + 100 * rank
    whole = torch.cat([torch.arange(32.0).reshape(2, 16) + 100 * r for r in range(WORLD)])
    results: dict[str, Any] = {"whole": whole, "piece": piece}
    for label, tp in TP_APIS:
        gather = tp.parallelize_module(
            nn.Identity(),
            mesh,
            tp.PrepareModuleInput(
                input_layouts=TorchShard(0), desired_input_layouts=TorchReplicate()
            ),
        )
        out = gather(piece)
        results[f"{label}-input"] = out.full_tensor() if isinstance(out, TorchDTensor) else out
        chunk = tp.parallelize_module(
            nn.Identity(),
            mesh,
            tp.PrepareModuleOutput(
                output_layouts=TorchReplicate(), desired_output_layouts=TorchShard(0)
            ),
        )
        results[f"{label}-output"] = _local(chunk(whole))
    return results


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + y
        return out


class _KeywordInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + y
        return out


def _case_multiple_inputs() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict[str, Any] = {}
    torch.manual_seed(6)
    x = torch.randn(2, 8)
    y = torch.ones(WORLD * 2, 8 // WORLD)
    for label, tp in TP_APIS:
        short = _TwoInputs()
        tp.parallelize_module(short.linear, mesh, tp.ColwiseParallel())
        tp.parallelize_module(
            short,
            mesh,
            tp.PrepareModuleInput(
                input_layouts=TorchShard(0), desired_input_layouts=TorchReplicate()
            ),
        )
        try:
            short(x, y)
            results[f"{label}-short"] = None
        except ValueError as error:
            results[f"{label}-short"] = str(error)
        torch.manual_seed(7)
        both = _TwoInputs()
        tp.parallelize_module(both.linear, mesh, tp.ColwiseParallel())
        tp.parallelize_module(
            both,
            mesh,
            tp.PrepareModuleInput(
                input_layouts=(TorchShard(0), None), desired_input_layouts=(TorchReplicate(), None)
            ),
        )
        with torch.no_grad():  # see the test: hp refuses a sharded input's unknown output
            results[f"{label}-both"] = _local(both(x, y))
        torch.manual_seed(8)
        keyword = _KeywordInput()
        tp.parallelize_module(
            keyword.linear, mesh, tp.ColwiseParallel(output_layouts=TorchReplicate())
        )
        tp.parallelize_module(
            keyword,
            mesh,
            tp.PrepareModuleInput(
                input_kwarg_layouts={"y": TorchShard(0)},
                desired_input_kwarg_layouts={"y": TorchReplicate()},
                use_local_output=True,
            ),
        )
        torch.manual_seed(9)
        xk = torch.randn(WORLD, 8)
        y_piece = torch.ones(1, 8) * (dist.get_rank() + 1)
        with torch.no_grad():
            keyword(xk, y=y_piece)  # hp learns the sharded extents on a first call (_run)
            with CommDebugMode() as mode:
                out = keyword(xk, y=y_piece)
        results[f"{label}-kwarg"] = (_local(out), _names(mode))
    return results


def _case_sequence_parallel() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(9)
    whole = torch.rand(4, 3 * WORLD, 12)
    norm = nn.LayerNorm(12)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    reference = norm(whole)
    reference.sum().backward()
    results: dict[str, Any] = {
        "reference": reference.detach(),
        "reference_grads": {n: p.grad.clone() for n, p in norm.named_parameters()},  # type: ignore[union-attr]
    }
    for label, tp in TP_APIS:
        module = tp.parallelize_module(copy.deepcopy(norm), mesh, tp.SequenceParallel())
        module.zero_grad()
        sharded = distribute_tensor(whole, mesh, [TorchShard(1)])
        with CommDebugMode() as forward:
            out = module(sharded)
        with CommDebugMode() as backward:
            out.backward(torch.ones_like(out))
        local = _local(out)
        results[label] = (
            type(out).__name__,
            local.detach(),
            _names(forward),
            _names(backward),
            _grads(module),
        )
    return results


def _case_replicated_torch_dtensor_input() -> dict[str, Any]:
    """A torch DTensor (replicated, built from a leaf that requires grad) into a column-parallel
    Linear with a gathered output: the leaf's gradient, on both sides and on one device."""
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _linear()
    torch.manual_seed(13)
    x = torch.rand(5, 16)
    weights = torch.linspace(-2, 2, 16)
    leaf = x.clone().requires_grad_()
    (model(leaf) * weights).sum().backward()
    assert leaf.grad is not None
    results: dict[str, Any] = {"one": leaf.grad.clone()}
    for label, tp in TP_APIS:
        module = tp.parallelize_module(
            copy.deepcopy(model), mesh, tp.ColwiseParallel(output_layouts=TorchReplicate())
        )
        leaf = x.clone().requires_grad_()
        out = module(TorchDTensor.from_local(leaf, mesh, [TorchReplicate()]))
        out = out.full_tensor() if isinstance(out, TorchDTensor) else out
        (out * weights).sum().backward()
        assert leaf.grad is not None
        results[label] = leaf.grad.clone()
    return results


def _case_keyword_forms() -> dict[str, Any]:
    """torch's keyword call, ``parallelize_module(module=, device_mesh=, parallelize_plan=)``,
    on both libraries: the same module."""
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _linear()
    torch.manual_seed(12)
    x = torch.rand(3, 16)
    outs = {}
    for label, api in TP_APIS:
        module = api.parallelize_module(
            module=copy.deepcopy(model),
            device_mesh=mesh,
            parallelize_plan={"": api.ColwiseParallel(output_layouts=TorchReplicate())},
        )
        outs[label] = _local(module(x)).detach()
    return {"outs": outs, "whole": model(x).detach()}


def _case_meshes() -> dict[str, Any]:
    """hp's own mesh and torch's give the same module; a torch mesh keeps its own groups."""
    torch_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    ours_mesh = DeviceMesh.from_torch(torch_mesh)
    model = _linear()
    torch.manual_seed(10)
    x = torch.rand(3, 16)
    outs = {}
    for label, mesh in (("torch-mesh", torch_mesh), ("hp-mesh", ours_mesh)):
        module = hp_tp.parallelize_module(
            copy.deepcopy(model), mesh, {"": hp_tp.ColwiseParallel(output_layouts=Replicate())}
        )
        outs[label] = module(x).detach()
    return {"outs": outs, "whole": model(x).detach()}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net2(self.relu(self.net1(x)))
        return out


def _case_mlp(plan_keys: tuple[str, str]) -> dict[str, Any]:
    """An MLP (nested one level, as torch's test) under a plan whose keys may be patterns
    (fnmatch per dotted component, as torch matches them); one SGD step on both sides and on
    one device; the parameters after it, gathered whole."""
    mesh = init_device_mesh("cpu", (WORLD,))
    reference = nn.Sequential()
    reference.add_module("encoder", _MLP())
    torch.manual_seed(12)
    x = torch.rand(12, 10)
    results: dict[str, Any] = {}
    for label, tp in (("one", None), *TP_APIS):
        model = copy.deepcopy(reference)
        if tp is not None:
            plan = {plan_keys[0]: tp.ColwiseParallel(), plan_keys[1]: tp.RowwiseParallel()}
            tp.parallelize_module(model, mesh, plan)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
        out = model(x)
        (out * out).sum().backward()
        optimizer.step()
        results[label] = (_local(out).detach(), _whole_params(model))
    return results


def _whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole: torch's by ``full_tensor``, hp's (local shards annotated with
    their layout) gathered along the sharded dim."""
    from hp_dtensor import layout_of

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, TorchDTensor):
            out[name] = p.full_tensor().detach()
            continue
        layout = layout_of(p)
        whole = p.detach()
        for dim in range(p.dim()):
            if layout.dim_sharding(dim):
                pieces = [torch.empty_like(whole) for _ in range(WORLD)]
                dist.all_gather(pieces, whole.contiguous())
                whole = torch.cat(pieces, dim=dim)
        out[name] = whole
    return out


def _same(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=0, atol=tol)


def _same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        _same(a[name], b[name], tol)


AR = "c10d_functional.all_reduce"
AG = "c10d_functional.all_gather_into_tensor"
RS = "c10d_functional.reduce_scatter_tensor"


def test_colwise_linear_counts_and_values() -> None:
    """torch: output Shard(-1) locally (8, 16/2), no collective in forward, one all-reduce in
    backward (the replicated input's gradient). hp: the same, counted under the same key."""
    for rank in run_on_ranks(WORLD, _case_colwise, timeout=60):
        hp, theirs = rank["hp"], rank["torch"]
        assert hp[0].shape == (8, 16 // WORLD)
        _same(hp[0], theirs[0])
        assert theirs[1] == {}
        assert hp[1] == {}
        assert theirs[2] == {AR: 1}
        assert hp[2] == {AR: 1}
        _same_grads(hp[3], theirs[3])
        _same(hp[4], theirs[4])


def test_colwise_sharded_input_counts_and_values() -> None:
    """``ColwiseParallel(input_layouts=Shard(0))`` (a torch placement): one all-gather in
    forward, one reduce-scatter in backward, on both sides."""
    for rank in run_on_ranks(WORLD, _case_colwise_sharded_input, timeout=60):
        hp, theirs = rank["hp"], rank["torch"]
        assert hp[0].shape == (8 * WORLD, 16 // WORLD)
        _same(hp[0], theirs[0])
        assert theirs[1] == {AG: 1}
        assert hp[1] == {AG: 1}
        assert theirs[2] == {RS: 1}
        assert hp[2] == {RS: 1}
        _same_grads(hp[3], theirs[3])


def test_rowwise_linear_replicated_output() -> None:
    """torch: one all-reduce in forward, none in backward. hp: the same values and gradients;
    the forward sum is counted under the same key and backward runs two all-reduces: the
    sum's adjoint (the model's edge hands the caller's gradient to one rank) and the bias's
    gradient reduction (hp's convention, README: the model's edge)."""
    for rank in run_on_ranks(WORLD, _case_rowwise, None, timeout=60):
        hp, theirs = rank["hp"], rank["torch"]
        assert hp[0].shape == (8, 16)
        _same(hp[0], theirs[0])
        assert theirs[1] == {AR: 1}
        assert theirs[2] == {}
        assert hp[1] == {AR: 1}
        assert hp[2] == {AR: 2}
        _same_grads(hp[3], theirs[3])


def test_rowwise_linear_sharded_output() -> None:
    """``RowwiseParallel(output_layouts=Shard(0))``: a reduce-scatter in forward and an
    all-gather in backward on both sides (hp also reduces the bias's gradient)."""
    for rank in run_on_ranks(WORLD, _case_rowwise, TorchShard(0), timeout=60):
        hp, theirs = rank["hp"], rank["torch"]
        assert hp[0].shape == (8 // WORLD, 16)
        _same(hp[0], theirs[0])
        assert theirs[1] == {RS: 1}
        assert hp[1] == {RS: 1}
        assert theirs[2] == {AG: 1}
        assert hp[2] == {AG: 1, AR: 1}
        _same_grads(hp[3], theirs[3])


def test_embedding_styles() -> None:
    """Column-wise embedding: no collective either way; row-wise (vocabulary) embedding with a
    replicated input: one all-reduce in forward. Values and gradients equal torch's."""
    for rank in run_on_ranks(WORLD, _case_embedding, timeout=60):
        for kind in ("colwise", "rowwise"):
            hp, theirs = rank[f"hp-{kind}"], rank[f"torch-{kind}"]
            _same(hp[0], theirs[0])
            _same_grads(hp[3], theirs[3])
        assert rank["hp-colwise"][0].shape == (4, 2, 16 // WORLD)
        assert rank["torch-colwise"][1:3] == ({}, {})
        assert rank["hp-colwise"][1:3] == ({}, {})
        assert rank["torch-rowwise"][1] == {AR: 1}
        assert rank["hp-rowwise"][1] == {AR: 1}


def test_styles_preserve_requires_grad() -> None:
    for rank in run_on_ranks(WORLD, _case_requires_grad, timeout=60):
        for kind in ("col", "row"):
            assert rank[f"hp-{kind}"] == rank[f"torch-{kind}"] == (False, True)


def test_prepare_module_input_and_output() -> None:
    """``PrepareModuleInput(input_layouts=Shard(0))`` (one placement, not a tuple) gathers the
    pieces; ``PrepareModuleOutput(Replicate -> Shard(0))`` keeps this rank's chunk. torch hands
    on a DTensor (its default ``use_local_output=False``), hp production mode the local tensor."""
    for index, rank in enumerate(run_on_ranks(WORLD, _case_prepare, timeout=60)):
        _same(rank["hp-input"], rank["whole"])
        _same(rank["torch-input"], rank["whole"])
        mine = rank["whole"].chunk(WORLD)[index]
        _same(rank["hp-output"], mine)
        _same(rank["torch-output"], mine)


def test_prepare_module_input_lengths_and_keywords() -> None:
    """A call with more positional inputs than ``input_layouts`` is a ValueError on both sides;
    ``(Shard(0), None)`` converts only the first; keyword layouts convert ``y`` (with the
    column-parallel output gathered: two all-gathers on both sides). Run without gradients:
    with them, hp refuses a tensor that requires grad and leaves a model whose plan shards an
    input without saying how the output is laid out (PlanError, README)."""
    for rank in run_on_ranks(WORLD, _case_multiple_inputs, timeout=60):
        assert rank["torch-short"] is not None
        assert rank["hp-short"] is not None
        assert "input_layouts should have same length" in rank["hp-short"]
        _same(rank["hp-both"], rank["torch-both"])
        out, counts = rank["hp-kwarg"]
        _same(out, rank["torch-kwarg"][0])
        assert counts == rank["torch-kwarg"][1] == {AG: 2}


def test_sequence_parallel_layer_norm_takes_torch_dtensors() -> None:
    """A torch DTensor sharded on the sequence dim into a SequenceParallel LayerNorm (torch's
    test; before, hp met "mixed torch.Tensor and DTensor" in native_layer_norm): same local
    output, no collective in forward on either side. torch hands on a DTensor and leaves the
    parameters' gradients Partial; hp hands on the local shard and reduces the replicated
    parameters' gradients in backward (one all-reduce): both equal one device's."""
    for index, rank in enumerate(run_on_ranks(WORLD, _case_sequence_parallel, timeout=60)):
        piece = rank["reference"].chunk(WORLD, dim=1)[index]
        hp_kind, hp_out, hp_fwd, hp_bwd, hp_grads = rank["hp"]
        t_kind, t_out, t_fwd, t_bwd, t_grads = rank["torch"]
        assert (t_kind, hp_kind) == ("DTensor", "Tensor")
        _same(t_out, piece)
        _same(hp_out, piece)
        assert t_fwd == {}
        assert hp_fwd == {}
        assert t_bwd == {}
        assert hp_bwd == {AR: 1}
        _same_grads(hp_grads, rank["reference_grads"])
        _same_grads(t_grads, rank["reference_grads"])


def test_replicated_torch_dtensor_input_gradient() -> None:
    """A replicated torch DTensor that requires grad: taken apart before the model's edge, so
    its gradient is summed once (the edge's all-reduce), equal to torch's and one device's."""
    for rank in run_on_ranks(WORLD, _case_replicated_torch_dtensor_input, timeout=60):
        _same(rank["hp"], rank["one"], 1e-5)
        _same(rank["torch"], rank["one"], 1e-5)


def test_torch_mesh_and_hp_mesh_give_the_same_module() -> None:
    for rank in run_on_ranks(WORLD, _case_meshes, timeout=60):
        _same(rank["outs"]["torch-mesh"], rank["whole"])
        _same(rank["outs"]["hp-mesh"], rank["whole"])


# Single-process: what the styles accept and refuse when they are built ----------------------


def test_length_mismatch_refused_when_built_with_torchs_type() -> None:
    with pytest.raises(AssertionError) as theirs:
        torch_tp.PrepareModuleInput(
            input_layouts=TorchShard(0), desired_input_layouts=(TorchReplicate(), None)
        )
    with pytest.raises(PlanLayoutLengthError, match="input_layouts has 1 entries") as caught:
        hp_tp.PrepareModuleInput(
            input_layouts=TorchShard(0), desired_input_layouts=(TorchReplicate(), None)
        )
    # torch's sentence leads ours, so a test matching torch's message matches hp's.
    assert str(caught.value).startswith(str(theirs.value))
    assert isinstance(caught.value, AssertionError)
    assert isinstance(caught.value, PlanError)
    with pytest.raises(AssertionError):
        torch_tp.PrepareModuleOutput(
            output_layouts=(TorchReplicate(), TorchShard(0)), desired_output_layouts=TorchShard(0)
        )
    with pytest.raises(AssertionError, match="output_layouts has 2 entries"):
        hp_tp.PrepareModuleOutput(
            output_layouts=(TorchReplicate(), TorchShard(0)), desired_output_layouts=TorchShard(0)
        )
    with pytest.raises(AssertionError):
        torch_tp.PrepareModuleInput(
            input_kwarg_layouts={"x": TorchShard(0), "y": TorchShard(0)},
            desired_input_kwarg_layouts={"x": TorchReplicate()},
        )
    with pytest.raises(AssertionError, match="input_kwarg_layouts has 2 entries"):
        hp_tp.PrepareModuleInput(
            input_kwarg_layouts={"x": TorchShard(0), "y": TorchShard(0)},
            desired_input_kwarg_layouts={"x": TorchReplicate()},
        )


def test_torch_placements_are_converted() -> None:
    style = hp_tp.ColwiseParallel(input_layouts=TorchShard(0), output_layouts=TorchReplicate())
    assert (style.input_layouts, style.output_layouts) == (Shard(0), Replicate())
    prepared = hp_tp.PrepareModuleInput(
        input_layouts=TorchShard(0), desired_input_layouts=TorchReplicate()
    )
    assert prepared.input_layouts == (Shard(0),)
    assert prepared.desired_input_layouts == (Replicate(),)
    assert hp_tp.ShardingPlan(params={"weight": TorchShard(1)}).params == {"weight": Shard(1)}  # type: ignore[dict-item]
    with pytest.raises(InteropError, match="is not a placement this style can take"):
        hp_tp.RowwiseParallel(output_layouts="Replicate")  # type: ignore[arg-type]


def test_bare_style_and_torch_mesh_resolve_without_ranks() -> None:
    """A bare style is the plan of the module itself (torch's form), for ``resolve`` too."""
    from hp_layout import Mesh

    resolved = hp_tp.resolve(nn.Linear(4, 4), Mesh((2,), ("tp",)), hp_tp.ColwiseParallel())
    assert [m.name for m in resolved.modules] == [""]
    assert resolved.param("weight").layout.placements == (Shard(0),)


@pytest.mark.parametrize(
    "keys",
    [("encoder.net1", "encoder.net2"), ("*.net1", "encoder.net[2]"), ("enc*.net1", "*.ne?2")],
)
def test_mlp_plan_keys_match_as_torchs(keys: tuple[str, str]) -> None:
    """torch's plan keys are fnmatch patterns per dotted component (``*``, ``?``, ``[...]``);
    ours match the same modules. After one SGD step the output and every parameter equal
    torch's and one device's (fp32, 1e-5)."""
    for rank in run_on_ranks(WORLD, _case_mlp, keys, timeout=60):
        one_out, one_params = rank["one"]
        for label in ("hp", "torch"):
            out, params = rank[label]
            _same(out, one_out, 1e-5)
            _same_grads(params, one_params, 1e-5)


def test_torchs_keyword_call() -> None:
    for rank in run_on_ranks(WORLD, _case_keyword_forms, timeout=60):
        _same(rank["outs"]["hp"], rank["outs"]["torch"])
        _same(rank["outs"]["hp"], rank["whole"])


def test_arguments_hp_does_not_take_are_refused_by_name() -> None:
    """No current-mesh context (torch's ``with mesh:``) and no ``src_data_rank`` scatter: both
    refused before anything is sharded, naming what to pass instead; the plan under both of its
    names is refused."""
    layer = nn.Linear(4, 4)
    style = hp_tp.ColwiseParallel()
    with pytest.raises(TypeError, match="needs device_mesh"):
        hp_tp.parallelize_module(layer, parallelize_plan=style)
    with pytest.raises(NotImplementedError, match="src_data_rank=None"):
        hp_tp.parallelize_module(layer, None, style, src_data_rank=0)
    with pytest.raises(TypeError, match="give one"):
        hp_tp.parallelize_module(layer, None, style, parallelize_plan=style)
    assert layer.weight.shape == (4, 4)


def test_no_plan_and_bad_plans() -> None:
    """torch: no plan warns and leaves the module alone, a plan of another type is a TypeError.
    hp: the same. torch warns and skips a key that names no module; hp refuses it (PlanError)."""
    layer = nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="parallelize_plan"):
        assert hp_tp.parallelize_module(layer, None, None) is layer
    with pytest.raises(TypeError, match="give a style"):
        hp_tp.parallelize_module(layer, None, [hp_tp.ColwiseParallel()])  # type: ignore[arg-type]
    from hp_layout import Mesh

    with pytest.raises(PlanError, match="names no module"):
        hp_tp.resolve(_MLP(), Mesh((2,), ("tp",)), {"net3": hp_tp.ColwiseParallel()})
