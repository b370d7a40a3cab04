"""The trainer's MoE layers (``hp_train.model.moe``) against the test model ``hp_testing.moe``.

``hp_testing.moe.MoE`` is written apart from hp-dtensor's ``moe_ops`` (which the trainer's
layers compose) and is itself checked against a per-token float64 reference in hp-dtensor's
``test_oracle_moe.py``; here the trainer's layers, given the same parameters, must give the
same outputs, routing counts, auxiliary loss and gradients, in every routing variant. The
router's bias update is checked against its formula, and both layers are checked (statically,
by mypy, and at run time) to have the structure the expert-parallel styles shard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hp_dtensor.parallel import ExpertModule, ExpertParallel, PlanError, resolve
from hp_layout import Mesh
from hp_testing import moe as test_model
from hp_train.model.moe import MoE, TopKRouter

DIM, HIDDEN, EXPERTS, TOP_K, SHARED = 6, 5, 6, 2, 4

CASES = [
    ("softmax", {}),
    ("softmax", {"route_scale": 2.5, "aux_loss_coef": 0.05}),
    ("sigmoid", {"shared_hidden": SHARED, "aux_loss_coef": 0.05}),
    ("sigmoid", {"normalize_weights": False, "route_scale": 1.5, "shared_hidden": SHARED}),
]


def _pair(score_func: str, options: dict[str, Any]) -> tuple[MoE, test_model.MoE]:
    kwargs: dict[str, Any] = {"score_func": score_func, "use_expert_bias": True, **options}
    torch.manual_seed(0)
    ours = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    reference = test_model.MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    assert ours.router.expert_bias is not None
    ours.router.expert_bias.copy_(torch.tensor([0.15, -0.1, 0.05, 0.0, -1e3, 0.1]))
    reference.load_state_dict(ours.state_dict())
    return ours, reference


@pytest.mark.parametrize(("score_func", "options"), CASES)
def test_trainer_moe_equals_the_test_model(score_func: str, options: dict[str, Any]) -> None:
    ours, reference = _pair(score_func, options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, DIM, generator=g)
    probe = torch.randn(3, 8, DIM, generator=g)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [m(xi) for m, xi in zip((ours, reference), xs, strict=True)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    assert ours.last_counts is not None
    assert reference.last_counts is not None
    assert ours.last_counts.tolist() == reference.last_counts.tolist()
    assert ours.last_counts[4] == 0  # the bias keeps expert 4 out
    if ours.aux_loss_coef:
        assert ours.last_aux_loss is not None
        assert reference.last_aux_loss is not None
        torch.testing.assert_close(ours.last_aux_loss, reference.last_aux_loss)
    else:
        assert ours.last_aux_loss is None
    for out in outs:
        (out * probe).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-6, atol=1e-7)
    want = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, want[name].grad, rtol=1e-6, atol=1e-7, msg=name)


def test_update_expert_bias_moves_towards_balance() -> None:
    router = TopKRouter(4, 4, 1, use_expert_bias=True)
    assert router.expert_bias is not None
    start = torch.tensor([0.5, 0.0, -0.25, 0.0])
    router.expert_bias.copy_(start)
    counts = torch.tensor([7, 1, 2, 2])
    router.update_expert_bias(counts, rate=0.1)
    # bias += rate * sign(mean - count): the overloaded expert 0 down, the others up.
    torch.testing.assert_close(router.expert_bias, start + 0.1 * torch.tensor([-1, 1, 1, 1]))
    with pytest.raises(RuntimeError, match="no expert bias"):
        TopKRouter(4, 4, 1).update_expert_bias(counts, rate=0.1)


def test_both_layers_have_the_structure_expert_parallelism_shards() -> None:
    layers: list[ExpertModule] = [MoE(8, 12, 4, 2), test_model.MoE(8, 12, 4, 2)]
    for layer in layers:
        assert isinstance(layer, torch.nn.Module)
        plan = resolve(layer, Mesh((2,), ("ep",)), {"": ExpertParallel()}, dp_axes=())
        assert [p.fqn for p in plan.params if p.style == "ExpertParallel"] == [
            "experts.w1",
            "experts.w2",
            "experts.w3",
        ]
    with pytest.raises(PlanError, match=r"lacks: .*router\.weight"):
        resolve(torch.nn.Linear(2, 2), Mesh((2,), ("ep",)), ExpertParallel(), dp_axes=())
