"""hp-fsdp against torch FSDP2's public surface: every ``fully_shard`` keyword and every
``FSDPModule`` method torch has is either implemented or refused by name, and the README's
table lists each with that status (so the table cannot drift from the code).

Behaviour of the FSDP2 calls not covered elsewhere (world 2): ``unshard(async_op=True)``
returns a handle whose ``wait()`` puts the unsharded parameters on the module;
``register_fsdp_forward_method`` runs another method under the forward hooks (its output
equals the unsharded model's); ``set_reshard_after_forward(False)`` keeps the parameters
gathered after forward; ``set_reduce_scatter_divide_factor`` scales the gradients; each refused
call raises ``NotImplementedError`` naming itself.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

from hp_fsdp import FSDPModule, fully_shard
from hp_fsdp.compat import REFUSED_METHODS
from hp_testing import run_on_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
REFUSED_KEYWORDS = {"shard_placement_fn", "ignored_params", "dp_mesh_dims"}


def _torch_methods() -> list[str]:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    return [n for n in dir(TorchFSDPModule) if not n.startswith("_")]


def _torch_keywords() -> list[str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return [n for n in inspect.signature(torch_fully_shard).parameters if n != "module"]


def _readme_rows() -> dict[str, str]:
    """First-column names (backticked, a trailing ``=`` kept) -> status column."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (match := re.fullmatch(r"`([^`]+)`", cells[0])):
            rows[match.group(1)] = cells[1]
    return rows


def test_every_fsdp2_name_is_implemented_or_refused_and_in_the_readme() -> None:
    rows = _readme_rows()
    ours = set(inspect.signature(fully_shard).parameters)
    for keyword in _torch_keywords():
        assert keyword in ours, keyword
        status = rows[f"{keyword}="]
        assert status.startswith("refused") == (keyword in REFUSED_KEYWORDS), keyword
    for name in _torch_methods():
        assert callable(getattr(FSDPModule, name, None)), name
        assert rows[name].startswith("refused") == (name in REFUSED_METHODS), name
    import hp_fsdp

    for name in ("fully_shard(module)", "register_fsdp_forward_method", "UnshardHandle"):
        assert hasattr(hp_fsdp, name.removesuffix("(module)"))
        assert rows[name].startswith("supported"), name


class _Generator(nn.Module):
    """A model with a method called instead of forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x)
        return out

    def generate(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = torch.tanh(self.proj(x))
        return x


def _behaviour() -> dict[str, Any]:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import register_fsdp_forward_method
    from hp_layout import Mesh

    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    reference = _Generator()
    torch.manual_seed(0)
    block = nn.Sequential(_Generator())
    fully_shard(block[0], mesh=mesh)
    model = cast(Any, fully_shard(block, mesh=mesh))
    inner = cast(Any, block[0])
    handle = inner.unshard(async_op=True)
    out["handle"] = type(handle).__name__
    handle.wait()
    out["unsharded_shape"] = tuple(inner.proj.weight.shape)
    inner.reshard()
    out["resharded_shape"] = tuple(inner.proj.weight.shape)
    register_fsdp_forward_method(inner, "generate")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model(x)  # the root's lazy initialization
    out["generate_error"] = (inner.generate(x, 3) - reference.generate(x, 3)).abs().max().item()
    out["after_generate_shape"] = tuple(inner.proj.weight.shape)
    inner.set_reshard_after_forward(False)
    model(x)
    out["kept_shape"] = tuple(inner.proj.weight.shape)
    inner.set_reshard_after_forward(True)
    grads = []
    for factor in (None, 0.5):
        if factor is not None:
            model.set_reduce_scatter_divide_factor(factor)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        grads.append(inner.proj.weight.grad.clone())
    out["factor_ratio"] = (grads[1] / grads[0]).nan_to_num(4.0).sub(4.0).abs().max().item()
    messages = {}
    for name in REFUSED_METHODS:
        try:
            getattr(model, name)()
            messages[name] = "no error"
        except NotImplementedError as error:
            messages[name] = str(error)
    for keyword, value in (("shard_placement_fn", lambda p: None), ("ignored_params", set())):
        try:
            cast(Any, fully_shard)(nn.Linear(2, 2), mesh=mesh, **{keyword: value})
            messages[keyword] = "no error"
        except NotImplementedError as error:
            messages[keyword] = str(error)
    try:
        cast(Any, fully_shard)(nn.Linear(2, 2), mesh=mesh, reshard_after_forward=2)
        messages["int"] = "no error"
    except NotImplementedError as error:
        messages["int"] = str(error)
    out["messages"] = messages
    return out


@pytest.mark.multiprocess
def test_fsdp2_calls_behave() -> None:
    for result in run_on_ranks(2, _behaviour):
        assert result["handle"] == "UnshardHandle"
        assert result["unsharded_shape"] == (4, 4)
        assert len(result["resharded_shape"]) == 1  # this rank's 1-d piece
        assert result["generate_error"] == 0.0
        assert result["after_generate_shape"] == result["resharded_shape"]
        assert result["kept_shape"] == (4, 4)
        # Dividing by 0.5 instead of 2 ranks: 4 times the averaged gradient.
        assert result["factor_ratio"] < 1e-6
        messages = result["messages"]
        for name in REFUSED_METHODS:
            assert f"FSDPModule.{name}" in messages[name]
        assert "shard_placement_fn=" in messages["shard_placement_fn"]
        assert "ignored_params=" in messages["ignored_params"]
        assert "smaller mesh" in messages["int"]
