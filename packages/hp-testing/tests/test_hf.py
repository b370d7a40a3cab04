"""The tiny Hugging Face models: deterministic by seed, with the module names the plans use."""

from __future__ import annotations

import pytest
import torch

from hp_testing.hf import KINDS, causal_lm, tp_plan_styles


@pytest.mark.parametrize("kind", KINDS)
def test_models_are_seeded_and_the_plans_name_their_modules(kind: str) -> None:
    first, second = causal_lm(kind, seed=3), causal_lm(kind, seed=3)
    for p, q in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q)
    names = {name for name, _ in first.named_modules()}
    for pattern, style in tp_plan_styles(kind).items():
        assert style in ("colwise", "rowwise")
        assert pattern.replace("*", "0") in names, pattern
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    out = first(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 5, 64)
    assert out.loss.shape == ()


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model kind 'gpt'"):
        causal_lm("gpt")
