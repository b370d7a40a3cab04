"""What Muon refuses: a group with no parameters, a parameter that is not a matrix by its global
shape. A 1-d flat piece of a 2-d matrix (hp-fsdp's flat layout) is a matrix and is accepted;
a 1-d piece of a 1-d tensor is not. Every error names the parameter and what to do instead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hp_dtensor import annotate_layout
from hp_layout import Layout, Mesh, RaggedShard
from hp_muon import (
    FLAT_LAYOUT_HINT,
    Muon,
    ParamSplit,
    check_muon_params,
    flat_pieces_of_matrices,
    muon_with_adamw,
    split_params,
)

PER_PARAM = 'param_layout="per_param"'


def _flat_piece(global_shape: tuple[int, ...], held: int) -> nn.Parameter:
    """Rank 0's first ``held`` elements of a tensor of ``global_shape`` flattened over two
    ranks, as hp-fsdp's flat layout hands it out: a 1-d tensor annotated with its layout."""
    numel = 1
    for n in global_shape:
        numel *= n
    layout = Layout(
        global_shape, Mesh((2,), ("shard",), (0, 1)), [RaggedShard((held, numel - held))]
    )
    return annotate_layout(nn.Parameter(torch.zeros(held)), layout, rank=0)


def test_empty_group_is_refused_naming_the_flat_layout() -> None:
    groups: list[dict[str, Any]] = [{"params": [nn.Parameter(torch.randn(4, 3))]}, {"params": []}]
    with pytest.raises(ValueError, match="Muon parameter group 1 has no parameters") as caught:
        Muon(groups, ns_dtype=torch.bfloat16)
    assert PER_PARAM in str(caught.value)
    assert "p.ndim == 2" in str(caught.value)
    # torch's own Muon accepts such a group and steps nothing.
    torch.optim.Muon(groups)


def test_a_refused_group_is_not_added() -> None:
    opt = Muon([nn.Parameter(torch.randn(4, 3))], ns_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has no parameters"):
        opt.add_param_group({"params": []})
    with pytest.raises(ValueError, match="not a matrix"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(5))]})
    assert len(opt.param_groups) == 1


def test_one_dim_parameter_is_refused_by_name() -> None:
    bias = nn.Parameter(torch.randn(6))
    with pytest.raises(ValueError, match=r"parameter 'fc.bias' has global shape \(6,\)") as caught:
        Muon([("fc.weight", nn.Parameter(torch.randn(6, 4))), ("fc.bias", bias)])
    message = str(caught.value)
    assert "AdamW" in message
    # A plain 1-d tensor may be a flat shard of a sharder that records no layout.
    assert PER_PARAM in message
    with pytest.raises(ValueError, match=r"parameter 1 has global shape \(\)"):
        Muon([nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.tensor(1.0))])


def test_flat_piece_of_a_matrix_is_accepted_and_of_a_vector_refused() -> None:
    """By global shape: a (5,) piece of a (3, 4) matrix is a matrix; a (5,) piece of a (7,)
    bias is not, and the message says the per-parameter layout would not change that."""
    opt = Muon([_flat_piece((3, 4), 5)], ns_dtype=torch.bfloat16)
    assert len(opt.param_groups[0]["params"]) == 1
    with pytest.raises(ValueError, match=r"global shape \(7,\)") as caught:
        Muon([_flat_piece((7,), 5)], ns_dtype=torch.bfloat16)
    message = str(caught.value)
    assert "1-d flat piece of shape (5,)" in message
    assert PER_PARAM in message


def test_flat_pieces_of_matrices_lists_what_ndim_misses() -> None:
    named = [
        ("a", _flat_piece((3, 4), 5)),
        ("b", _flat_piece((7,), 2)),
        ("c", nn.Parameter(torch.zeros(3, 4))),
        ("d", _flat_piece((2, 3, 4), 10)),
    ]
    assert flat_pieces_of_matrices(named) == [("a", (5,), (3, 4)), ("d", (10,), (2, 3, 4))]


def test_check_names_missed_flat_pieces_of_the_model() -> None:
    model = nn.Module()
    model.w = _flat_piece((3, 4), 5)
    with pytest.raises(ValueError, match="my group has no parameters") as caught:
        check_muon_params([], "my group", model_params=model.named_parameters())
    message = str(caught.value)
    assert (
        "1 1-d flat piece(s) of matrices, e.g. 'w' of local shape (5,) and global shape (3, 4)"
        in message
    )
    assert FLAT_LAYOUT_HINT in message
    check_muon_params([model.w], "my group")  # a piece of a matrix: fine


def test_muon_with_adamw_refuses_an_empty_muon_part() -> None:
    """A model whose split gives Muon nothing would train every parameter with AdamW."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4))
    assert split_params(model).muon == ()
    with pytest.raises(ValueError, match="the Muon part of the split has no parameters"):
        muon_with_adamw(model)
    norm = model[1]
    assert isinstance(norm, nn.LayerNorm)
    one_dim = ParamSplit(muon=(("1.weight", norm.weight),), adamw=())
    with pytest.raises(ValueError, match=r"parameter '1.weight' has global shape \(4,\)"):
        muon_with_adamw(model, split=one_dim)
