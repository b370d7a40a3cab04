"""``contract.set_materialize_target``: ``materialize`` writes a meta tensor's values into the
storage a sharder names (no second copy), equal to a single-device construction."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from hp_dtensor.contract import MaterializeTarget, set_materialize_target
from hp_dtensor.parallel import MaterializeError, materialize


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _fixed(view: torch.Tensor) -> MaterializeTarget:
    def target(device: torch.device) -> torch.Tensor:
        del device
        return view

    return target


def test_values_land_in_the_named_storage() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model = _meta_model()
    params = list(model.parameters())
    storage = torch.zeros(sum(p.numel() for p in params))
    offsets, start = [], 0
    for p in params:
        offsets.append(start)
        view = storage[start : start + p.numel()].view(p.shape)
        set_materialize_target(p, _fixed(view))
        start += p.numel()
    materialize(model, seed=0)
    for p, q, offset in zip(model.parameters(), reference.parameters(), offsets, strict=True):
        # The parameter aliases the named storage (no copy of its own) and holds the values.
        assert p.data_ptr() == storage[offset:].data_ptr()
        assert torch.equal(p, q)
    first = cast(nn.Linear, reference[0])
    assert torch.equal(storage[: params[0].numel()].view(4, 3), first.weight)


def test_a_target_of_the_wrong_shape_is_named() -> None:
    model = _meta_model()
    set_materialize_target(cast(nn.Linear, model[0]).weight, lambda device: torch.zeros(5))
    with pytest.raises(MaterializeError, match="the target of 'weight' is"):
        materialize(model, seed=0)
