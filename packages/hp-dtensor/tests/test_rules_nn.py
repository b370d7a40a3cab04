"""nn rules (softmax, norms, embedding, attention, losses, dropout) against single-device ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _harness import CheckReport, check_op, placement_options
from hp_dtensor import DeviceMesh, DTensor, distribute_tensor
from hp_dtensor.rules.registry import OpCall, ShardingDecision, ShardingRuleError, rule_for
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks

Case = tuple[Callable[..., Any], list[torch.Tensor], list[list[Placement]] | None]

IDS_OPTIONS: list[Placement] = [Replicate(), Shard(0), Shard(1)]
NO_PARTIAL_1D: list[Placement] = [Replicate(), Shard(0)]


def _t(*shape: int, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * sum(shape))
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)


def _sdpa(**kwargs: Any) -> Callable[..., Any]:
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> Any:
        attn_mask = mask[0] if mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)

    return op


def _norm_cases() -> dict[str, Case]:
    x = _t(5, 3, 4)
    return {
        "softmax": (lambda a: F.softmax(a, dim=1), [x], None),
        "softmax_forms": (
            lambda a: (a.softmax(0), torch.special.log_softmax(a, 1), F.softmin(a, -1)),
            [_t(5, 3)],
            None,
        ),
        "log_softmax_dtype": (
            lambda a: torch.log_softmax(a, -1, dtype=torch.float64),
            [_t(3, 5)],
            None,
        ),
        "layer_norm": (
            lambda a, w, b: F.layer_norm(a, (3, 4), w, b),
            [x, _t(3, 4, seed=1), _t(3, 4, seed=2)],
            None,
        ),
        "torch_layer_norm": (
            lambda a, w, b: torch.layer_norm(a, [4], w, b, 1e-5),
            [x, _t(4, seed=1), _t(4, seed=2)],
            None,
        ),
        "rms_norm": (
            lambda a, w: (F.rms_norm(a, (4,), w, eps=1e-6), torch.rms_norm(a, [3, 4])),
            [x, _t(4, seed=3)],
            None,
        ),
    }


def _embedding_cases() -> dict[str, Case]:
    ids = torch.tensor([[0, 6, 3], [5, 5, 1], [2, 4, 6], [1, 0, 3], [6, 2, 5]])
    w = _t(7, 5)
    opts = [IDS_OPTIONS, placement_options(2)]
    return {
        "embedding": (F.embedding, [ids, w], opts),
        "embedding_padding": (lambda i, v: F.embedding(i, v, padding_idx=-2), [ids, w], opts),
        "torch_embedding_freq": (
            lambda i, v: torch.embedding(v, i, 3, True),
            [ids, w],
            opts,
        ),
        # Vocab 3 over mesh (2, 2) nested on dim 0: one rank holds no rows at all.
        "embedding_empty_vocab_shard": (
            F.embedding,
            [torch.tensor([[0, 2], [1, 1], [2, 0]]), _t(3, 4)],
            [[Replicate(), Shard(0)], [Shard(0)]],
        ),
    }


def _attention_cases() -> dict[str, Case]:
    q, k, v = _t(2, 3, 5, 4), _t(2, 3, 6, 4, seed=1), _t(2, 3, 6, 2, seed=2)
    mask = torch.rand(2, 1, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    seq_mask = torch.ones(3, 5, 6, dtype=torch.bool).tril(1)
    return {
        "sdpa": (_sdpa(), [q, k, v], None),
        "sdpa_causal": (_sdpa(is_causal=True, scale=0.3), [q, k, v], None),
        "sdpa_float_mask": (_sdpa(), [q, k, v, mask], None),
        "sdpa_3d_bool_mask": (
            _sdpa(),
            [_t(3, 5, 4), _t(3, 6, 4, seed=4), _t(3, 6, 3, seed=5), seq_mask],
            [*[placement_options(3)] * 3, [Replicate(), Shard(0), Shard(1), Shard(2)]],
        ),
        "sdpa_broadcast_batch": (_sdpa(), [q, _t(1, 3, 6, 4), _t(3, 6, 2, seed=6)], None),
        "sdpa_gqa_even": (
            _sdpa(enable_gqa=True),
            [_t(2, 4, 5, 4), _t(2, 2, 6, 4, seed=7), _t(2, 2, 6, 3, seed=8)],
            None,
        ),
        "sdpa_gqa_uneven": (
            _sdpa(enable_gqa=True, is_causal=True),
            [_t(2, 6, 3, 2), _t(2, 3, 3, 2, seed=9), _t(2, 3, 3, 2, seed=10)],
            None,
        ),
    }


def _loss_cases() -> dict[str, Case]:
    logits = _t(5, 4)
    target = torch.tensor([1, -100, 3, 0, 2])
    opts = [placement_options(2), NO_PARTIAL_1D]
    cases: dict[str, Case] = {
        f"cross_entropy_{reduction}": (
            lambda x, y, r=reduction: F.cross_entropy(x, y, reduction=r, label_smoothing=0.1),
            [logits, target],
            opts,
        )
        for reduction in ("none", "sum", "mean")
    }
    weight = torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float64)
    target_3d = torch.tensor([[0, 1, -100, 3, 2], [3, 3, 1, -100, 0], [2, 0, 1, 1, 3]])
    cases["cross_entropy_weighted_3d"] = (
        lambda x, y, w: F.cross_entropy(x, y, w, label_smoothing=0.2),
        [_t(3, 4, 5), target_3d, weight],
        [placement_options(3), [Replicate(), Shard(0), Shard(1)], placement_options(1)],
    )
    probs = torch.softmax(_t(5, 4, grad=False, seed=1), -1)
    cases["cross_entropy_probabilities"] = (
        lambda x, y: F.cross_entropy(x, y, label_smoothing=0.1),
        [logits, probs],
        [placement_options(2), [Replicate(), Shard(0), Shard(1)]],
    )
    cases["nll_loss_weighted"] = (
        lambda x, y, w: F.nll_loss(F.log_softmax(x, 1), y, weight=w, ignore_index=0),
        [logits, target.clamp_min(0), weight],
        [placement_options(2), NO_PARTIAL_1D, placement_options(1)],
    )
    cases["nll_loss_unbatched"] = (
        lambda x, y: F.nll_loss(x, y, reduction="sum"),
        [_t(4), torch.tensor(2)],
        [placement_options(1), [Replicate()]],
    )
    return cases


def _dropout_cases() -> dict[str, Case]:
    x = _t(5, 3, 4)
    return {
        "dropout_identity": (
            lambda a: (
                F.dropout(a, 0.5, training=False),
                torch.dropout(a, 0.0, True),
                F.alpha_dropout(a, 0.3),
                F.dropout1d(a, 0.0),
            ),
            [x],
            None,
        ),
    }


def _all_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for family in (_norm_cases, _embedding_cases, _attention_cases, _loss_cases, _dropout_cases):
        cases.update(family())
    return cases


ALL = sorted(_all_cases())

# Cases with more placement combinations than the time budget allows on the 1-d mesh.
SAMPLED_1D = {
    "sdpa": 64,
    "sdpa_causal": 64,
    "sdpa_float_mask": 64,
    "sdpa_3d_bool_mask": 64,
    "sdpa_broadcast_batch": 64,
    "sdpa_gqa_even": 64,
    "sdpa_gqa_uneven": 64,
}


# Four-input cases on the 2-d mesh: fewer options per input, since the harness enumerates
# every combination before sampling (6 options over 2 axes for 4 inputs is 1.7M combinations).
OPTIONS_2D: dict[str, list[list[Placement]]] = {
    "sdpa_float_mask": [
        [Replicate(), Shard(0), Shard(1), Shard(2)],
        [Replicate(), Shard(1), Shard(2), Partial()],
        [Replicate(), Shard(0), Shard(3), Partial()],
        [Replicate(), Shard(0), Shard(2), Shard(3)],
    ],
    "sdpa_3d_bool_mask": [
        [Replicate(), Shard(0), Shard(1), Partial()],
        [Replicate(), Shard(0), Shard(1), Shard(2)],
        [Replicate(), Shard(0), Shard(2), Partial()],
        [Replicate(), Shard(0), Shard(1), Shard(2)],
    ],
}


def _check(
    names: list[str], mesh_shape: tuple[int, ...], limit: int | None
) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _all_cases()
    reports = {}
    for name in names:
        op, inputs, options = cases[name]
        if len(mesh_shape) > 1:
            options = OPTIONS_2D.get(name, options)
        reports[name] = check_op(
            op,
            inputs,
            mesh_shape,
            options=options,
            max_combinations=limit if len(mesh_shape) > 1 else SAMPLED_1D.get(name),
            atol=1e-9,
        )
    return reports


def _assert_reports(results: list[dict[str, CheckReport]]) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert not report.rejected, f"rank {rank} {name}:\n" + "\n".join(report.rejected)
            assert report.accepted, f"{name}: no combination was tried"


@pytest.mark.multiprocess
def test_nn_rules_on_a_1d_mesh_all_or_sampled_combinations() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), None, timeout=600))


@pytest.mark.multiprocess
def test_nn_rules_on_a_2d_mesh_sampled() -> None:
    _assert_reports(run_on_ranks(4, _check, ALL, (2, 2), 8, timeout=600))


# Dropout with p > 0: layouts, and every element either dropped or scaled ------------------------


def _dropout_body(mesh_shape: tuple[int, ...], p: float) -> list[str]:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    value = _t(5, 3, 4, grad=False) + 3.0  # no zeros
    layouts: list[tuple[Placement, ...]] = [
        (Replicate(),) * len(mesh_shape),
        (Shard(0),) * len(mesh_shape),
        (Shard(2), *(Replicate(),) * (len(mesh_shape) - 1)),
        (Partial(), *(Shard(1),) * (len(mesh_shape) - 1)),
    ]
    problems: list[str] = []
    for placements in layouts:
        for name, op in (
            ("dropout", lambda a: F.dropout(a, p)),
            ("feature_dropout", lambda a: torch.feature_dropout(a, p, True)),
        ):
            torch.manual_seed(1234)  # identical streams: replicas draw identical masks
            problems += _dropout_check(name, op, value, mesh, placements, p)
    return problems


def _dropout_check(
    name: str,
    op: Callable[[torch.Tensor], torch.Tensor],
    value: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    p: float,
) -> list[str]:
    x = _from_value(value, mesh, placements)
    out = op(x)
    assert isinstance(out, DTensor)
    label = f"{name} {list(placements)}"
    want = [Replicate() if isinstance(q, Partial) else q for q in placements]
    problems = []
    if list(out.placements) != want:
        problems.append(f"{label}: output placements {list(out.placements)}, want {want}")
    full = out.full_tensor().detach()
    kept = torch.isclose(full, value / (1 - p))
    if not bool((kept | (full == 0)).all()):
        problems.append(f"{label}: elements neither dropped nor scaled by 1/(1-p)")
    if name == "feature_dropout" and not bool((kept.all(-1) | (full == 0).all(-1)).all()):
        problems.append(f"{label}: a channel was dropped only in part")
    out.sum().backward()
    grad = x.grad
    assert isinstance(grad, DTensor)
    if not torch.allclose(grad.full_tensor(), kept.to(value.dtype) / (1 - p)):
        problems.append(f"{label}: gradient is not mask / (1 - p)")
    return problems


def _from_value(value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    if not any(isinstance(q, Partial) for q in placements):
        out = distribute_tensor(value, mesh, placements, src_data_rank=None)
        return out.requires_grad_()  # type: ignore[return-value]
    # Partial on the first axis: rank coordinate 0 holds the value, the others zeros.
    plain = [Replicate() if isinstance(q, Partial) else q for q in placements]
    shard = distribute_tensor(value, mesh, plain, src_data_rank=None).to_local()
    first = mesh.get_local_rank(0) == 0
    local = (shard if first else torch.zeros_like(shard)).clone().requires_grad_()
    return DTensor.from_local(local, mesh, placements, shape=tuple(value.shape))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_dropout_keeps_layouts_and_drops_or_scales_each_element(world: int) -> None:
    mesh_shape = (2,) if world == 2 else (2, 2)
    for rank, problems in enumerate(run_on_ranks(world, _dropout_body, mesh_shape, 0.4)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


# Pure decisions --------------------------------------------------------------------------------

MESH = Mesh((2,), ("tp",))
MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, rank: int = 0, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    name = getattr(func, "__name__", "op")
    return rule(OpCall(func, name, args, kwargs, rank))


def _layout(shape: Sequence[int], *placements: Placement, mesh: Mesh = MESH) -> Layout:
    return Layout(tuple(shape), mesh, placements)


def test_softmax_on_a_sharded_dim_gathers_it_and_keeps_other_shards() -> None:
    x = _layout((4, 6, 8), Shard(2), Shard(0), mesh=MESH2)
    decision = _decide(F.softmax, x, dim=-1)
    assert decision.inputs[0].placements == (Replicate(), Shard(0))
    assert decision.outputs == decision.inputs[0]
    kept = _decide(torch.Tensor.softmax, _layout((4, 6), Shard(0)), 1)
    assert kept.outputs.placements == (Shard(0),)
    partial = _decide(torch.log_softmax, _layout((4, 6), Partial()), 0)
    assert partial.inputs[0].placements == (Replicate(),)


def test_layer_norm_replicates_weight_and_gathers_normalized_dims() -> None:
    x = _layout((4, 6, 8), Shard(0), Shard(2), mesh=MESH2)
    w = _layout((8,), Replicate(), Shard(0), mesh=MESH2)
    decision = _decide(F.layer_norm, x, (8,), weight=w, bias=None)
    assert decision.inputs[0].placements == (Shard(0), Replicate())
    assert decision.inputs[1].placements == (Replicate(), Replicate())
    assert decision.outputs.placements == (Shard(0), Replicate())


def test_embedding_decisions() -> None:
    ids = _layout((4, 3), Replicate())
    vocab = _decide(F.embedding, ids, _layout((7, 5), Shard(0)), rank=1)
    assert vocab.outputs.placements == (Partial(ReduceOp.SUM),)
    assert vocab.outputs.global_shape == (4, 3, 5)
    column = _decide(F.embedding, _layout((4, 3), Shard(1)), _layout((7, 5), Shard(1)))
    assert column.inputs[0].placements == (Replicate(),)  # the weight keeps its layout
    assert column.outputs.placements == (Shard(2),)
    rows = _decide(torch.embedding, _layout((7, 5), Replicate()), _layout((4, 3), Shard(1)))
    assert rows.outputs.placements == (Shard(1),)
    partial = _decide(F.embedding, ids, _layout((7, 5), Partial()))
    assert partial.inputs[1].placements == (Replicate(),)


def test_vocab_parallel_local_lookup_masks_other_ranks_rows() -> None:
    ids = _layout((2, 3), Replicate())
    decision = _decide(F.embedding, ids, _layout((7, 2), Shard(0)), rank=1)
    assert decision.local_func is not None
    local_weight = torch.arange(6.0).reshape(3, 2) + 1  # rows 4..6 of the vocab
    local_ids = torch.tensor([[0, 4, 6], [5, 3, 4]])
    out = decision.local_func(local_ids, local_weight)
    want = torch.tensor([[[0, 0], [1, 2], [5, 6]], [[3, 4], [0, 0], [1, 2]]], dtype=out.dtype)
    assert torch.equal(out, want)


def test_embedding_rejects_max_norm_and_sparse() -> None:
    ids, w = _layout((4,), Replicate()), _layout((7, 5), Shard(0))
    with pytest.raises(ShardingRuleError, match="max_norm renormalizes the weight in place"):
        _decide(F.embedding, ids, w, max_norm=1.0)
    with pytest.raises(ShardingRuleError, match="sparse gradients"):
        _decide(F.embedding, ids, w, sparse=True)


def test_sdpa_keeps_batch_and_head_shards_and_gathers_key_sequence() -> None:
    q = _layout((2, 4, 6, 8), Shard(0), Shard(1), mesh=MESH2)
    kv = _layout((2, 4, 6, 8), Replicate(), Shard(2), mesh=MESH2)
    decision = _decide(F.scaled_dot_product_attention, q, kv, kv)
    assert decision.outputs.placements == (Shard(0), Shard(1))
    assert all(x.placements == (Shard(0), Shard(1)) for x in decision.inputs)


def test_sdpa_query_sequence_shard_and_causal_offsets() -> None:
    q = _layout((2, 5, 4), Shard(1))
    kv = _layout((2, 6, 4), Replicate())
    plain = _decide(F.scaled_dot_product_attention, q, kv, kv)
    assert plain.outputs.placements == (Shard(1),)
    assert plain.local_func is None
    causal = _decide(F.scaled_dot_product_attention, q, kv, kv, is_causal=True, rank=1)
    assert causal.outputs.placements == (Shard(1),)
    assert causal.local_func is not None
    local_q = torch.randn(2, 2, 4, dtype=torch.float64)  # rows 3 and 4 of 5
    k = torch.randn(2, 6, 4, dtype=torch.float64)
    got = causal.local_func(local_q, k, k)
    mask = torch.ones(5, 6, dtype=torch.bool).tril()[3:]
    want = F.scaled_dot_product_attention(local_q, k, k, attn_mask=mask)
    assert torch.allclose(got, want)


def test_sdpa_grouped_heads_shard_only_when_even_and_dropout_is_rejected() -> None:
    q = _layout((2, 6, 5, 4), Replicate(), Shard(1), mesh=MESH2)
    kv = _layout((2, 3, 5, 4), Replicate(), Replicate(), mesh=MESH2)
    uneven = _decide(F.scaled_dot_product_attention, q, kv, kv, enable_gqa=True)
    assert uneven.outputs.placements == (Replicate(), Replicate())
    even_q = _layout((2, 8, 5, 4), Replicate(), Shard(1), mesh=MESH2)
    even_kv = _layout((2, 4, 5, 4), Replicate(), Replicate(), mesh=MESH2)
    even = _decide(F.scaled_dot_product_attention, even_q, even_kv, even_kv, enable_gqa=True)
    assert even.outputs.placements == (Replicate(), Shard(1))
    assert even.inputs[1].placements == (Replicate(), Shard(1))
    with pytest.raises(ShardingRuleError, match="dropout_p > 0"):
        _decide(F.scaled_dot_product_attention, q, q, q, dropout_p=0.1)


def test_sdpa_partial_value_stays_partial() -> None:
    q = _layout((2, 5, 4), Replicate())
    v = _layout((2, 5, 3), Partial())
    decision = _decide(F.scaled_dot_product_attention, q, q, v)
    assert decision.outputs.placements == (Partial(),)
    assert decision.inputs[2].placements == (Partial(),)


def test_loss_decisions() -> None:
    logits = _layout((5, 4), Shard(1), Shard(0), mesh=MESH2)
    target = _layout((5,), Replicate(), Replicate(), mesh=MESH2)
    mean = _decide(F.cross_entropy, logits, target)
    assert mean.inputs[0].placements == (Replicate(), Shard(0))
    assert mean.inputs[1].placements == (Replicate(), Shard(0))
    assert mean.outputs.placements == (Replicate(), Partial(ReduceOp.SUM))
    assert mean.outputs.global_shape == ()
    none = _decide(
        F.nll_loss, _layout((5, 4, 3), Shard(2)), _layout((5, 3), Replicate()), reduction="none"
    )
    assert none.outputs.placements == (Shard(1),)
    assert none.inputs[1].placements == (Shard(1),)


def test_dropout_decisions() -> None:
    x = _layout((4, 6), Partial())
    assert _decide(F.dropout, x, 0.1).outputs.placements == (Replicate(),)
    assert _decide(F.dropout, x, 0.1, training=False).outputs.placements == (Partial(),)
    assert _decide(torch.dropout, x, 0.0, True).outputs.placements == (Partial(),)
    spatial = _layout((2, 3, 8), Shard(2))  # channel-wise dropout keeps spatial shards too
    assert _decide(F.dropout1d, spatial, 0.5).outputs.placements == (Shard(2),)
    assert _decide(F.dropout, spatial, 0.5).outputs.placements == (Shard(2),)
    with pytest.raises(ShardingRuleError, match="in-place dropout"):
        _decide(F.dropout, x, 0.1, inplace=True)
