"""One device: ``hp_muon.Muon`` against ``torch.optim.Muon``, bit for bit, and the same errors.

The grid is PyTorch's own (``torch.testing._internal.common_optimizers.optim_inputs_func_muon``:
default, lr, Tensor lr, weight_decay, momentum, ns_steps, ns_coefficients) plus Nesterov off,
both lr adjustments and another eps. Parameters include same-shape matrices (batched into one
Newton-Schulz run on our side), so the batched path is covered too.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hp_muon import Muon

# Same-shape pairs run batched; no transposed pair (see test_mixed_orientation_batch).
SHAPES = ((32, 16), (32, 16), (16, 48), (24, 24), (24, 24), (40, 12), (40, 12), (7, 5))
STEPS = 5

TORCH_GRID: list[dict[str, Any]] = [
    {},
    {"lr": 0.01},
    {"lr": torch.tensor(0.001)},
    {"weight_decay": 0.2},
    {"momentum": 0.8},
    {"ns_steps": 6},
    {"ns_coefficients": (3.4, -4.7, 2.0)},
    # beyond torch's grid
    {"nesterov": False},
    {"adjust_lr_fn": "original", "lr": 0.02},
    {"adjust_lr_fn": "match_rms_adamw", "lr": 0.02, "weight_decay": 0.0},
    {"eps": 1e-3, "momentum": 0.0},
]


def _pair(
    shapes: tuple[tuple[int, ...], ...], seed: int = 0
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) for s in shapes]
    return [nn.Parameter(f.clone()) for f in fulls], [nn.Parameter(f.clone()) for f in fulls]


def _step_both(ours: list[nn.Parameter], theirs: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for a, b in zip(ours, theirs, strict=True):
        grad = torch.randn(a.shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()


@pytest.mark.parametrize("kwargs", TORCH_GRID, ids=lambda k: ",".join(k) or "default")
def test_bit_equal_to_torch_muon(kwargs: dict[str, Any]) -> None:
    ours, theirs = _pair(SHAPES)
    opt, ref = Muon(ours, **kwargs, ns_dtype=torch.bfloat16), torch.optim.Muon(theirs, **kwargs)
    for step in range(STEPS):
        _step_both(ours, theirs, step)
        opt.step()
        ref.step()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a, b), (
                f"param {i} {tuple(a.shape)} step {step}: {(a - b).abs().max()}"
            )
            assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])
    stats = opt.last_step_stats
    assert stats is not None
    assert stats.orthogonalized == len(SHAPES)
    assert stats.collectives == 0


def test_param_groups_named_params_and_closure() -> None:
    ours, theirs = _pair(SHAPES)
    groups_ours: list[dict[str, Any]] = [
        {"params": [("a", ours[0]), ("b", ours[1])], "lr": 0.05},
        {"params": [(f"p{i}", p) for i, p in enumerate(ours[2:])], "momentum": 0.5},
    ]
    groups_theirs: list[dict[str, Any]] = [
        {"params": [("a", theirs[0]), ("b", theirs[1])], "lr": 0.05},
        {"params": [(f"p{i}", p) for i, p in enumerate(theirs[2:])], "momentum": 0.5},
    ]
    opt, ref = Muon(groups_ours, ns_dtype=torch.bfloat16), torch.optim.Muon(groups_theirs)
    for step in range(3):
        _step_both(ours, theirs, step)
        assert opt.step(lambda: 1.5) == 1.5
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_state_dict_interchanges_with_torch() -> None:
    """State dicts use torch's keys: torch's state loads into ours (and back), steps go on equal."""
    ours, theirs = _pair(SHAPES)
    opt, ref = Muon(ours, lr=0.02, ns_dtype=torch.bfloat16), torch.optim.Muon(theirs, lr=0.02)
    for step in range(2):
        _step_both(ours, theirs, step)
        ref.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs, strict=True):
            a.copy_(b)
    # A copy, as from disk: loading keeps same-dtype tensors as they are (shared buffers).
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["ns_dtype"] == torch.bfloat16  # torch's groups have no such key
    for step in range(2, 4):
        _step_both(ours, theirs, step)
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # and back
    assert torch.equal(
        ref.state[theirs[0]]["momentum_buffer"], opt.state[ours[0]]["momentum_buffer"]
    )


def test_mixed_orientation_batch() -> None:
    """A matrix fused with its transposed shape: bit-equal unfused, within bf16 rounding fused."""
    shapes = ((12, 20), (20, 12), (12, 20))
    for fuse, bound in ((False, 0.0), (True, 2**-7 * 0.02 * 3)):
        ours, theirs = _pair(shapes, seed=3)
        opt, ref = (
            Muon(ours, lr=0.02, fuse_shapes=fuse, ns_dtype=torch.bfloat16),
            torch.optim.Muon(theirs, lr=0.02),
        )
        for step in range(3):
            _step_both(ours, theirs, step)
            opt.step()
            ref.step()
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        assert worst <= bound, (fuse, worst)


def test_expert_stack_is_per_matrix_torch_muon() -> None:
    """A 3-D parameter is a batch of matrices: equal to torch.optim.Muon on each matrix."""
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4, 10, 6, generator=g)
    stack = nn.Parameter(full.clone())
    singles = [nn.Parameter(m.clone()) for m in full]
    opt = Muon([stack], lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(singles, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _step in range(3):
        grad = torch.randn(full.shape, generator=g)
        stack.grad = grad.clone()
        for s, m in zip(singles, grad, strict=True):
            s.grad = m.clone()
        opt.step()
        ref.step()
    assert torch.equal(stack.detach(), torch.stack([s.detach() for s in singles]))
    # The extension: torch's Muon refuses the stack itself.
    with pytest.raises(ValueError, match="2D"):
        torch.optim.Muon([nn.Parameter(full.clone())])


def test_row_blocks_are_separate_matrices() -> None:
    """Fused QKV with row blocks (8, 4, 4): equal to torch.optim.Muon on the three blocks."""
    g = torch.Generator().manual_seed(6)
    full = torch.randn(16, 8, generator=g)
    fused = nn.Parameter(full.clone())
    blocks = [nn.Parameter(b.clone()) for b in full.split([8, 4, 4])]
    opt = Muon([{"params": [fused], "row_blocks": (8, 4, 4)}], lr=0.02, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(blocks, lr=0.02)
    for _step in range(3):
        grad = torch.randn(full.shape, generator=g)
        fused.grad = grad.clone()
        for b, piece in zip(blocks, grad.split([8, 4, 4]), strict=True):
            b.grad = piece.clone()
        opt.step()
        ref.step()
    assert torch.equal(fused.detach(), torch.cat([b.detach() for b in blocks]))
    heads = Muon([nn.Parameter(full.clone())], row_blocks=4, ns_dtype=torch.bfloat16)
    assert heads.param_groups[0]["row_blocks"] == 4


def test_presets_and_schedules_run() -> None:
    for spec in (
        "keller",
        "you_5step",
        "you_6step",
        "polar_express",
        [(3.4, -4.7, 2.0), (2.0, -1.5, 0.5)],
    ):
        (p,) = _pair(((16, 8),))[0]
        p.grad = torch.randn(16, 8)
        Muon([p], ns_coefficients=spec, ns_steps=8, ns_dtype=torch.bfloat16).step()
        assert torch.isfinite(p).all()


# Errors -----------------------------------------------------------------------------------------


def _construct(
    cls: type[torch.optim.Optimizer], params: Any, **kwargs: Any
) -> torch.optim.Optimizer:
    return cls(params, **kwargs)


@pytest.mark.parametrize(
    ("params", "kwargs", "error"),
    [
        ("tensor", {}, TypeError),
        ("duplicate groups", {}, ValueError),
        ("ok", {"lr": torch.tensor([0.001, 0.001])}, ValueError),
        ("ok", {"lr": -1.0}, ValueError),
        ("ok", {"momentum": -0.5}, ValueError),
        ("ok", {"weight_decay": -0.1}, ValueError),
        ("ok", {"adjust_lr_fn": "arbitrary"}, ValueError),
        ("named mix", {}, ValueError),
        ("1-d", {}, ValueError),
        ([], {}, ValueError),
    ],
)
def test_construction_errors_match_torch(params: Any, kwargs: dict[str, Any], error: type) -> None:
    def make() -> Any:
        a, b = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2, 3))
        return (
            {
                "tensor": a,
                "duplicate groups": [{"params": a}, {"params": a}],
                "ok": [a],
                "named mix": [("weight", a), b],
                "1-d": [nn.Parameter(torch.randn(3))],
            }.get(params, params)
            if isinstance(params, str)
            else params
        )

    for cls in (Muon, torch.optim.Muon):
        with pytest.raises(error):
            _construct(cls, make(), **kwargs)


def test_duplicate_params_warn_like_torch() -> None:
    a = nn.Parameter(torch.randn(2, 3))
    for cls in (Muon, torch.optim.Muon):
        with pytest.warns(UserWarning, match="duplicate parameters"):
            cls([a, a])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"ns_steps": 100}, ValueError), ({"ns_coefficients": (1.0, 2.0)}, ValueError)],
)
def test_step_errors_match_torch(kwargs: dict[str, Any], error: type) -> None:
    for cls in (Muon, torch.optim.Muon):
        p = nn.Parameter(torch.randn(4, 3))
        p.grad = torch.randn(4, 3)
        opt = cls([p], **kwargs)
        with pytest.raises(error):
            opt.step()


def test_complex_and_sparse_fail_at_step_like_torch() -> None:
    for cls in (Muon, torch.optim.Muon):
        c = torch.rand(2, 3, dtype=torch.complex64)
        c.grad = torch.rand_like(c)
        with pytest.raises(RuntimeError, match="complex"):
            cls([c]).step()
        s = nn.Parameter(torch.randn(4, 3))
        s.grad = torch.randn(4, 3).to_sparse()
        with pytest.raises(RuntimeError, match="sparse"):
            cls([s]).step()


def test_our_own_errors() -> None:
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match="row_blocks"):
        Muon([p], row_blocks=4, ns_dtype=torch.bfloat16)  # 4 does not divide 6
    with pytest.raises(ValueError, match="row_blocks"):
        Muon([p], row_blocks=(2, 2), ns_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        Muon([p], bucket_cap_mb=0, ns_dtype=torch.bfloat16)
    p.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match="unknown Newton-Schulz coefficient preset"):
        Muon([p], ns_coefficients="nope", ns_dtype=torch.bfloat16).step()
    opt = Muon([p], ns_dtype=torch.bfloat16)
    opt.state[p]["momentum_buffer"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="momentum buffer"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(
            [nn.Parameter(torch.randn(2, 3, 4))], ns_dtype=torch.bfloat16
        )  # 3-D: accepted (torch refuses it)
