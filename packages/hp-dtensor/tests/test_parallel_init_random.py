"""Distributed RNG and deferred initialization give the values of a single-device run.

Dropout (the plain-tensor function and the DTensor rule) and materialized parameters are
compared bit for bit with the same single-device computation under the same seed, for Shard
on every dim, nested and uneven (empty) shards, RaggedShard, Replicate and Partial inputs,
forward and backward, and the generator must advance exactly as on one device.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, annotate_layout, distribute_tensor, layout_of
from hp_dtensor.interop import LAYOUT_ATTRIBUTE
from hp_dtensor.parallel.init import (
    MaterializeError,
    materialize,
    materialize_target_of,
    set_materialize_target,
)
from hp_dtensor.parallel.random import (
    DropoutVariant,
    distributed_dropout,
    parallel_dropout_forward,
    random_region,
    take_region,
)
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, Replicate, Shard
from hp_testing import run_on_ranks

# Dropout references ----------------------------------------------------------------------------

REFERENCE: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "dropout": lambda x, p: F.dropout(x, p),
    "alpha_dropout": lambda x, p: F.alpha_dropout(x, p, True),
    "feature_dropout": lambda x, p: torch.feature_dropout(x, p, True),
    "feature_alpha_dropout": lambda x, p: F.feature_alpha_dropout(x, p, True),
    "dropout1d": lambda x, p: F.dropout1d(x, p),
    "dropout2d": lambda x, p: F.dropout2d(x, p),
    "dropout3d": lambda x, p: F.dropout3d(x, p),
}
VARIANTS: list[DropoutVariant] = [
    "dropout",
    "alpha_dropout",
    "feature_dropout",
    "feature_alpha_dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
]
# Global shapes: batched / unbatched forms of each channel-wise variant, an empty shard at 2.
SHAPES: list[tuple[int, ...]] = [(5, 3, 4), (1, 3, 4), (4, 6), (2, 3, 2, 3, 2)]


def _applies(variant: str, shape: Sequence[int]) -> bool:
    return variant != "dropout1d" or len(shape) in (2, 3)


def _value(shape: Sequence[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g)


class _Reference:
    """One single-device dropout under a seed: output, input gradient, generator state after."""

    def __init__(self, variant: str, value: torch.Tensor, grad: torch.Tensor, p: float, seed: int):
        x = value.clone().requires_grad_()
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dropout2d/3d warn about unusual dims
            out = REFERENCE[variant](x, p)
        self.rng = torch.get_rng_state()
        out.backward(grad)
        assert x.grad is not None
        self.out = out.detach()
        self.grad = x.grad


def _layouts(shape: tuple[int, ...], mesh: Mesh) -> list[Layout]:
    """Every Replicate/Shard combination (nested and uneven included) and RaggedShard cases."""
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    out = [Layout(shape, mesh, list(c)) for c in itertools.product(options, repeat=mesh.ndim)]
    for combo in itertools.product(options, repeat=mesh.ndim - 1):
        inner = Layout(shape, mesh, [*combo, Replicate()])
        blocks = {inner.local_numel(r) for r in mesh.ranks}
        if len(blocks) == 1:
            block = blocks.pop()
            parts = mesh.shape[-1]
            small = [block // (parts + 1)] * (parts - 1)
            ragged = RaggedShard([*small, block - sum(small)])
            out.append(Layout(shape, mesh, [*combo, ragged]))
    return out


def test_distributed_dropout_equals_single_device_bit_for_bit() -> None:
    torch.set_num_threads(1)
    meshes = [Mesh((2,), ("tp",)), Mesh((2, 2), ("dp", "tp")), Mesh((3,), ("tp",))]
    checked = 0
    for variant, shape in itertools.product(VARIANTS, SHAPES):
        if not _applies(variant, shape):
            continue
        value, grad = _value(shape, 1), _value(shape, 2)
        ref = _Reference(variant, value, grad, 0.4, seed=11)
        for mesh in meshes:
            for layout in _layouts(shape, mesh):
                for rank in mesh.ranks:
                    region = layout.local_region(rank)
                    x = take_region(value, region).clone().requires_grad_()
                    torch.manual_seed(11)
                    out = distributed_dropout(x, 0.4, True, layout, rank, variant=variant)
                    same_rng = torch.equal(torch.get_rng_state(), ref.rng)
                    out.backward(take_region(grad, region))
                    ok = (
                        same_rng
                        and torch.equal(out, take_region(ref.out, region))
                        and x.grad is not None
                        and torch.equal(x.grad, take_region(ref.grad, region))
                    )
                    if not ok:
                        pytest.fail(f"{variant} {layout!r} rank {rank}: differs from one device")
                    checked += 1
    assert checked > 2000


def test_distributed_dropout_edge_cases() -> None:
    layout = Layout((5, 4), Mesh((2,), ("tp",)), [Shard(0)])
    x = torch.randn(3, 4)
    assert distributed_dropout(x, 0.5, False, layout, 0) is x
    assert distributed_dropout(x, 0.0, True, layout, 0) is x
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert torch.equal(distributed_dropout(x, 1.0, True, layout, 0), torch.zeros(3, 4))
    assert torch.equal(torch.get_rng_state(), before)  # p == 1 draws nothing, as F.dropout
    empty = Layout((0, 4), Mesh((2,), ("tp",)), [Shard(0)])
    assert distributed_dropout(torch.randn(0, 4), 0.5, True, empty, 1).shape == (0, 4)
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ValueError, match="between 0 and 1"):
        distributed_dropout(x, 1.5, True, layout, 0)
    with pytest.raises(ValueError, match="Partial value must be reduced"):
        distributed_dropout(x, 0.5, True, layout.with_placements([Partial()]), 0)
    with pytest.raises(ValueError, match="gives shape"):
        distributed_dropout(x, 0.5, True, layout, 1)  # rank 1 holds 2 rows
    with pytest.raises(RuntimeError, match="dropout1d"):
        distributed_dropout(
            torch.randn(1, 2, 2, 2), 0.5, True, _one((2, 2, 2, 2)), 0, variant="dropout1d"
        )


def _one(shape: tuple[int, ...]) -> Layout:
    return Layout(shape, Mesh((2,), ("tp",)), [Shard(0)])


def test_in_place_and_module_forward_match_torch() -> None:
    mesh = Mesh((2,), ("tp",))
    value = _value((6, 4, 3), 5)
    layout = Layout(value.shape, mesh, [Shard(1)])
    modules: list[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]] = [
        (nn.Dropout(0.3), lambda t: F.dropout(t, 0.3)),
        (nn.Dropout(0.3, inplace=True), lambda t: F.dropout(t, 0.3, inplace=True)),
        (nn.Dropout1d(0.3), lambda t: F.dropout1d(t, 0.3)),
        (nn.Dropout2d(0.3, inplace=True), lambda t: F.dropout2d(t, 0.3, inplace=True)),
        (nn.AlphaDropout(0.3), lambda t: F.alpha_dropout(t, 0.3, True)),
        (nn.FeatureAlphaDropout(0.3), lambda t: F.feature_alpha_dropout(t, 0.3, True)),
    ]
    for module, single in modules:
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = single(value.clone())
        for rank in (0, 1):
            local = take_region(value, layout.local_region(rank)).clone()
            torch.manual_seed(4)
            out = parallel_dropout_forward(module, local, layout, rank)
            assert torch.equal(out, take_region(ref, layout.local_region(rank))), module
            assert (out is local) == bool(getattr(module, "inplace", False)), module
        module.eval()
        assert parallel_dropout_forward(module, local, layout, 1) is local
    torch.manual_seed(4)
    ref = F.dropout(value, 0.2)
    torch.manual_seed(4)
    out = parallel_dropout_forward(0.2, take_region(value, layout.local_region(0)), layout, 0)
    assert torch.equal(out, take_region(ref, layout.local_region(0)))
    with pytest.raises(TypeError, match="not a torch dropout module"):
        parallel_dropout_forward(nn.ReLU(), value, layout, 0)


def test_random_region_is_the_slice_of_a_global_draw() -> None:
    layout = Layout((8, 6), Mesh((2, 2), ("dp", "tp")), [Shard(0), RaggedShard([10, 14])])
    torch.manual_seed(9)
    full = nn.init.trunc_normal_(torch.empty(8, 6), std=0.02)
    for rank in range(4):
        torch.manual_seed(9)
        local = random_region(lambda t: nn.init.trunc_normal_(t, std=0.02), layout, rank)
        assert torch.equal(local, take_region(full, layout.local_region(rank)))
        assert local.is_contiguous()


# The DTensor dropout rule, on ranks --------------------------------------------------------------


def _from_value(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``value`` as a DTensor; Partial axes: coordinate 0 holds the value, the others zeros."""
    plain = [Replicate() if isinstance(q, Partial) else q for q in placements]
    if plain == list(placements):
        out = distribute_tensor(value, mesh, placements, src_data_rank=None)
        return out.requires_grad_()  # type: ignore[return-value]
    shard = distribute_tensor(value, mesh, plain, src_data_rank=None).to_local()
    names = mesh.mesh_dim_names
    axes = [n for n, q in zip(names, placements, strict=True) if isinstance(q, Partial)]
    first = all(mesh.get_local_rank(n) == 0 for n in axes)
    local = (shard if first else torch.zeros_like(shard)).clone().requires_grad_()
    return DTensor.from_local(local, mesh, placements, shape=tuple(value.shape))


def _rule_cases(mesh_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], list[Placement]]]:
    if len(mesh_shape) == 1:
        return [
            ((5, 3, 4), [Replicate()]),
            ((5, 3, 4), [Shard(0)]),
            ((5, 3, 4), [Shard(1)]),
            ((5, 3, 4), [Shard(2)]),
            ((5, 3, 4), [Partial()]),
            ((5, 3, 4), [RaggedShard([25, 35])]),
            ((1, 3, 4), [Shard(0)]),
            ((4, 6), [Shard(1)]),
            ((2, 3, 2, 3, 2), [Shard(4)]),
        ]
    return [
        ((5, 3, 4), [Shard(0), Shard(0)]),
        ((5, 3, 4), [Shard(0), Shard(1)]),
        ((5, 3, 4), [Replicate(), Shard(2)]),
        ((5, 3, 4), [Partial(), Shard(1)]),
        ((6, 3, 5), [Shard(0), RaggedShard([20, 25])]),
        ((2, 3, 2, 3, 2), [Shard(1), Shard(3)]),
    ]


def _rule_problems(mesh: DeviceMesh) -> list[str]:
    problems: list[str] = []
    for index, (shape, placements) in enumerate(_rule_cases(mesh.shape)):
        value, grad = _value(shape, index), _value(shape, 100 + index)
        for variant in VARIANTS:
            if not _applies(variant, shape):
                continue
            ref = _Reference(variant, value, grad, 0.3, seed=index)
            x = _from_value(value, mesh, placements)
            torch.manual_seed(index)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = REFERENCE[variant](x, 0.3)
            label = f"{variant} {shape} {placements}"
            if not torch.equal(torch.get_rng_state(), ref.rng):
                problems.append(f"{label}: the generator advanced differently")
            assert isinstance(out, DTensor)
            want = [Replicate() if isinstance(q, Partial) else q for q in placements]
            if list(out.placements) != want:
                problems.append(f"{label}: output placements {list(out.placements)}")
            seed = distribute_tensor(grad, mesh, out.placements, src_data_rank=None)
            out.backward(seed)  # type: ignore[no-untyped-call]
            if not torch.equal(out.full_tensor().detach(), ref.out):
                problems.append(f"{label}: output differs from single device")
            x_grad = x.grad
            assert isinstance(x_grad, DTensor)
            if not torch.equal(x_grad.full_tensor(), ref.grad):
                problems.append(f"{label}: gradient differs from single device")
    problems += _in_place_problems(mesh)
    return problems


def _in_place_problems(mesh: DeviceMesh) -> list[str]:
    value = _value((5, 3, 4), 7)
    placements = [Shard(1)] * mesh.ndim
    problems = []
    ops: list[tuple[str, Callable[[torch.Tensor], object]]] = [
        ("torch.dropout_", lambda t: torch.dropout_(t, 0.3, True)),
        ("F.dropout(inplace)", lambda t: F.dropout(t, 0.3, inplace=True)),
        ("torch.feature_dropout_", lambda t: torch.feature_dropout_(t, 0.3, True)),
    ]
    for name, op in ops:
        torch.manual_seed(5)
        ref = value.clone()
        op(ref)
        x = distribute_tensor(value, mesh, placements, src_data_rank=None)
        torch.manual_seed(5)
        op(x)
        if not torch.equal(x.full_tensor(), ref):
            problems.append(f"{name}: in-place result differs from single device")
    return problems


# Deferred initialization ------------------------------------------------------------------------

V, H, KV, FFN, SEQ = 11, 10, 6, 14, 5


class Norm(nn.Module):
    """An RMSNorm-like module without reset_parameters (its init draws random numbers)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))


class Rotary(nn.Module):
    """Rotary tables as non-persistent buffers, recomputed by ``tables``."""

    def __init__(self, dim: int, seq: int) -> None:
        super().__init__()
        self.dim, self.seq = dim, seq
        cos, sin = self.tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        angles = torch.outer(torch.arange(self.seq, dtype=torch.float32), inv)
        return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(H, H)
        self.wk = nn.Linear(H, KV)
        self.wv = nn.Linear(H, KV)
        self.wo = nn.Linear(H, H)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(H)
        self.attn = Attention()
        self.ffn_norm = Norm(H)
        self.mlp = MLP()


class Toy(nn.Module):
    """A small Llama-like model: embedding, two blocks, norms, LM head, rotary tables."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H, padding_idx=0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(H)
        self.output = nn.Linear(H, V, bias=False)
        self.rotary = Rotary(H // 2, SEQ)
        if tie:
            self.output.weight = self.embed.weight


def _init_fn(module: nn.Module) -> None:
    if isinstance(module, Norm):
        module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape))


def _buffer_fn(module: nn.Module) -> None:
    if isinstance(module, Rotary):
        module.cos, module.sin = module.tables()


def _plan(mesh_shape: tuple[int, ...]) -> dict[str, list[Placement]]:
    """TP layouts (column Shard(0), row Shard(1)); on (dp, tp) also nested and ragged ones."""
    if len(mesh_shape) == 1:
        return {
            "embed.weight": [Shard(1)],
            "layers.0.attn.wq.weight": [Shard(0)],
            "layers.0.attn.wq.bias": [Shard(0)],
            "layers.0.attn.wk.weight": [Shard(0)],
            "layers.0.attn.wk.bias": [Shard(0)],
            "layers.0.attn.wo.weight": [Shard(1)],
            "layers.0.attn.wo.bias": [Replicate()],
            "layers.0.mlp.w1.weight": [Shard(0)],
            "layers.0.mlp.w2.weight": [Shard(1)],
            "layers.1.mlp.w2.weight": [RaggedShard([57, 83])],
            "layers.1.attn.wv.weight": [Shard(0)],
            "output.weight": [Shard(0)],
        }
    return {
        "embed.weight": [Shard(0), Shard(1)],
        "layers.0.attn.wq.weight": [RaggedShard([20, 30]), Shard(0)],
        "layers.0.attn.wq.bias": [Replicate(), Shard(0)],
        "layers.0.attn.wk.weight": [Replicate(), Shard(0)],
        "layers.0.attn.wo.weight": [Replicate(), Shard(1)],
        "layers.0.mlp.w1.weight": [Shard(0), Shard(0)],
        "layers.1.mlp.w2.weight": [RaggedShard([7, 63]), Shard(1)],
        "layers.1.attn.wv.weight": [Replicate(), Shard(0)],
        "output.weight": [Shard(0), Shard(0)],
    }


def _convert(
    model: nn.Module, mesh: DeviceMesh, plan: dict[str, list[Placement]], mode: str
) -> None:
    """What parallelize_module does on meta: DTensor parameters, or annotated local shards.

    In ``dtensor`` mode every parameter becomes a DTensor (Replicate where the plan is
    silent); in ``annotated`` mode the planned ones become annotated local shards and the
    others stay plain (whole).
    """
    rank = mesh.get_rank()
    for name, param in list(model.named_parameters()):
        placements = plan.get(name)
        if placements is None and mode == "annotated":
            continue
        layout = Layout(tuple(param.shape), mesh.mesh, placements or [Replicate()] * mesh.ndim)
        local = torch.empty(layout.local_shape(rank), dtype=param.dtype, device="meta")
        new: nn.Parameter
        if mode == "dtensor":
            new = nn.Parameter(DTensor(local, layout, mesh), param.requires_grad)
        else:
            new = annotate_layout(nn.Parameter(local, param.requires_grad), layout, rank=rank)
        new.__dict__.update(vars(param))
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, new)


def _on_meta(model: nn.Module) -> nn.Module:
    """``model`` moved to meta: the same result as building it under ``torch.device("meta")``,
    without the meta ``normal_`` that imports ``torch._dynamo`` (seconds) on first use."""
    return model.to("meta")


def _meta_model() -> Toy:
    model = _on_meta(Toy())
    assert isinstance(model, Toy)
    model.get_parameter("layers.0.attn.wk.bias").requires_grad_(False)
    model.get_parameter("layers.0.attn.wq.weight")._style = "colwise"  # type: ignore[attr-defined]
    return model


def _materialize_problems(mesh: DeviceMesh, mode: str) -> list[str]:
    torch.manual_seed(0)
    reference = Toy()
    after_construction = torch.get_rng_state()
    model = _meta_model()
    plan = _plan(mesh.shape)
    _convert(model, mesh, plan, mode)
    torch.manual_seed(123)  # materialize reseeds
    materialize(model, "cpu", seed=0, init_fn=_init_fn, buffer_fn=_buffer_fn)
    problems = []
    if not torch.equal(torch.get_rng_state(), after_construction):
        problems.append(f"{mode}: the generator advanced differently from construction")
    rank = mesh.get_rank()
    for name, want in reference.named_parameters():
        got = model.get_parameter(name)
        problems += _compare_param(f"{mode} {name}", got, want, plan.get(name), mode, rank)
    for name, want_buffer in reference.named_buffers():
        got_buffer = model.get_buffer(name)
        if got_buffer.is_meta or not torch.equal(got_buffer, want_buffer):
            problems.append(f"{mode} buffer {name}: differs from single device")
    if getattr(model.get_parameter("layers.0.attn.wq.weight"), "_style", None) != "colwise":
        problems.append(f"{mode}: a parameter attribute was lost")
    return problems


def _compare_param(
    label: str,
    got: torch.Tensor,
    want: torch.Tensor,
    placements: list[Placement] | None,
    mode: str,
    rank: int,
) -> list[str]:
    requires_grad = not label.endswith("layers.0.attn.wk.bias")  # switched off on meta
    if not isinstance(got, nn.Parameter) or got.requires_grad != requires_grad:
        return [f"{label}: not a Parameter with requires_grad={requires_grad}"]
    if mode == "dtensor":
        if not isinstance(got, DTensor):
            return [f"{label}: not a DTensor"]
        layout, local = got.dist_layout, got.to_local()
    elif placements is None:
        if isinstance(got, DTensor) or hasattr(got, LAYOUT_ATTRIBUTE):
            return [f"{label}: should stay a plain, whole tensor"]
        layout, local = layout_of(got), got
    else:
        layout, local = layout_of(got), got
    if placements is not None and list(layout.placements) != placements:
        return [f"{label}: layout {layout!r}, want {placements}"]
    expected = take_region(want, layout.local_region(rank)) if layout.is_sharded else want
    if local.device.type != "cpu" or not torch.equal(local.detach(), expected.detach()):
        return [f"{label}: local values differ from the single-device slice"]
    return []


def _on_rank(mesh_shape: tuple[int, ...]) -> dict[str, list[str]]:
    torch.set_num_threads(1)
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    return {
        "dropout rule": _rule_problems(mesh),
        "materialize dtensor": _materialize_problems(mesh, "dtensor"),
        "materialize annotated": _materialize_problems(mesh, "annotated"),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_dropout_rule_and_materialize_on_ranks(mesh_shape: tuple[int, ...]) -> None:
    world = 2 if len(mesh_shape) == 1 else 4
    for rank, result in enumerate(run_on_ranks(world, _on_rank, mesh_shape, timeout=300)):
        for what, problems in result.items():
            assert not problems, f"rank {rank} {what}:\n" + "\n".join(problems)


# Materialize in one process --------------------------------------------------------------------


def test_materialize_plain_model_with_tied_weights_equals_construction() -> None:
    torch.manual_seed(0)
    reference = Toy(tie=True)
    state = torch.get_rng_state()
    model = _on_meta(Toy())
    assert isinstance(model, Toy)
    model.output.weight = model.embed.weight  # .to() unties
    materialize(model, seed=0, init_fn=_init_fn, buffer_fn=_buffer_fn)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.output.weight is model.embed.weight
    for (name, got), want in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name


def test_materialize_with_layouts_by_name_and_rank() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(7, 5)
    layout = Layout((5, 7), Mesh((2, 2), ("dp", "tp")), [Shard(1), Shard(0)])
    for rank in range(4):
        model = _on_meta(nn.Linear(7, 5))
        assert isinstance(model, nn.Linear)
        model.weight = nn.Parameter(torch.empty(layout.local_shape(rank), device="meta"))
        materialize(model, seed=0, layouts={"weight": layout}, rank=rank)
        assert layout_of(model.weight) == layout
        assert torch.equal(
            model.weight, take_region(reference.weight.detach(), layout.local_region(rank))
        )
        assert torch.equal(model.bias, reference.bias)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(3))


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))


def test_materialize_errors_name_the_module() -> None:
    model = _on_meta(nn.Sequential(nn.Linear(3, 3), _Scale()))
    with pytest.raises(
        MaterializeError, match=r"module '1' \(_Scale\) owns meta parameters \['alpha'\].*init_fn="
    ):
        materialize(model)
    tables = _on_meta(nn.Sequential(_Tables()))
    with pytest.raises(
        MaterializeError, match=r"module '0' \(_Tables\) owns meta buffers \['table'\].*buffer_fn="
    ):
        materialize(tables)
    model = _on_meta(nn.Sequential(_Scale()))
    with pytest.raises(
        MaterializeError, match="parameter 'alpha' still holds values its initializer did not write"
    ):
        materialize(model, init_fn=lambda m: None)
    with pytest.raises(ValueError, match="no parameter or buffer"):
        materialize(model, layouts={"0.beta": Layout((3,), Mesh((1,), ("a",)), [Replicate()])})
    with pytest.raises(ValueError, match="not meta"):
        materialize(model, "meta")


def test_materialize_custom_init_and_buffers() -> None:
    model = _on_meta(nn.Sequential(_Scale(), _Tables()))

    def init_fn(module: nn.Module) -> None:
        if isinstance(module, _Scale):
            module.alpha.fill_(2.0)

    def buffer_fn(module: nn.Module) -> None:
        module.get_buffer("table").copy_(torch.arange(4.0))

    materialize(model, init_fn=init_fn, buffer_fn=buffer_fn)
    alpha = model.get_parameter("0.alpha")
    assert isinstance(alpha, nn.Parameter)
    assert torch.equal(alpha, torch.full((3,), 2.0))
    assert torch.equal(model.get_buffer("1.table"), torch.arange(4.0))


def test_materialize_target_is_recorded_and_read_back() -> None:
    meta = torch.empty(3, device="meta")
    assert materialize_target_of(meta) is None
    storage = torch.zeros(3)
    set_materialize_target(meta, lambda device: storage)
    target = materialize_target_of(meta)
    assert target is not None
    assert target(torch.device("cpu")) is storage
