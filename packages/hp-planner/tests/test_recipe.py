"""The recipe's vocabulary: checkpointing budgets parsed to bytes, bad words refused by name."""

from __future__ import annotations

import pytest

from hp_planner import PlanInputError
from hp_planner.price import PricingError, StepShape
from hp_planner.recipe import AC_MODES, ac_budget_bytes


@pytest.mark.parametrize(("text", "mib"), [("budget:64", 64), ("budget:0.5", 0.5), ("budget:1", 1)])
def test_a_budget_is_mebibytes(text: str, mib: float) -> None:
    assert ac_budget_bytes(text) == int(mib * 1024 * 1024)
    assert StepShape(8, 32, ac=text).ac_budget_bytes == int(mib * 1024 * 1024)


@pytest.mark.parametrize("mode", AC_MODES)
def test_a_mode_has_no_budget(mode: str) -> None:
    assert ac_budget_bytes(mode) is None


@pytest.mark.parametrize(
    "text", ["budget:", "budget:0", "budget:-3", "budget:nan", "bugdet:4", "all"]
)
def test_a_bad_policy_is_named(text: str) -> None:
    with pytest.raises(PlanInputError, match=f"got {text!r}"):
        ac_budget_bytes(text)
    with pytest.raises(PricingError, match="budget:<MiB>"):
        StepShape(8, 32, ac=text)
