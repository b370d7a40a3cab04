"""``fully_shard(plan=...)``: the group plans a call computes, compared with the ones it was
given, field by field, before anything is allocated.

A job planner (e.g. one holding a whole job's plan) hands every executor its part; the executor
plans again from the live module and refuses to run a plan it would not have made, naming the
first difference, so a planner and an executor that drift apart fail at setup rather than
train differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

from hp_fsdp.group_plan import GroupPlan

__all__ = ["check_group_plans", "first_difference"]

_SCALARS = (int, float, str, bool, type(None))

# GroupPlan fields holding one entry per parameter, in buffer order.
_PER_PARAM = ("fqns", "shapes", "bases", "layouts")


def first_difference(planned: Any, given: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """``(where, planned value, given value)`` of the first difference of two plans, or None
    when they are equal. Unequal tuples, dataclasses and annotated classes (``Layout``,
    ``Mesh``) are searched depth first (attributes in declaration order) for the innermost
    unequal part; ``where`` is its dotted path, e.g.
    ``flat.chunk_numel`` or ``layouts[2]``."""
    if planned == given:
        return None
    here = (path or "plan", planned, given)
    if type(planned) is not type(given):
        return here
    if isinstance(planned, tuple):
        if all(isinstance(v, _SCALARS) for v in (*planned, *given)):
            return here  # names, ranks, a shape: shown whole
        if len(planned) != len(given):
            return (f"{path} (length)", len(planned), len(given))
        for i, (a, b) in enumerate(zip(planned, given, strict=True)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found is not None:
                return found
        return here
    for name in _attributes(planned):
        inner = f"{path}.{name}" if path else name
        found = first_difference(getattr(planned, name), getattr(given, name), inner)
        if found is not None:
            return found
    return here


def _attributes(value: object) -> list[str]:
    """The public attributes a plan value is made of: a dataclass's fields, or the annotated
    attributes of a class such as ``hp_layout.Layout`` and ``Mesh``; none for a plain value."""
    if is_dataclass(value) and not isinstance(value, type):
        return [f.name for f in fields(value)]
    annotated = getattr(type(value), "__annotations__", {})
    return [n for n in annotated if not n.startswith("_") and hasattr(value, n)]


def _named(where: str, plan: GroupPlan) -> str:
    """``where``, with the parameter named for a per-parameter field (``layouts[2]`` ->
    ``layouts[2] (parameter 'w2.weight')``)."""
    for name in _PER_PARAM:
        prefix = f"{name}["
        if where.startswith(prefix) and "]" in where:
            index = int(where[len(prefix) : where.index("]")])
            if index < len(plan.fqns):
                return f"{where} (parameter {plan.fqns[index]!r})"
    return where


def check_group_plans(
    label: str, planned: Sequence[GroupPlan], given: GroupPlan | Sequence[GroupPlan]
) -> None:
    """Check that ``given`` (one plan, or one per storage dtype) equals what the call of
    ``label`` planned, every field but ``owner``.

    Raises:
        TypeError: ``given`` is not a GroupPlan or a sequence of them.
        ValueError: a different number of groups, or the first differing field, named with
            the module, the group and both values.
    """
    plans = (given,) if isinstance(given, GroupPlan) else tuple(given)
    if not all(isinstance(p, GroupPlan) for p in plans):
        raise TypeError(
            f"fully_shard({label!r}): plan= takes a hp_fsdp.GroupPlan or a sequence of them "
            f"(one per storage dtype), got {type(given).__name__}"
        )
    if len(plans) != len(planned):
        raise ValueError(
            f"fully_shard({label!r}): plan= has {len(plans)} group plan(s), this call makes "
            f"{len(planned)} (one per storage dtype: "
            f"{[p.storage_dtype for p in planned]}); pass plan_fully_shard's plans"
        )
    for index, (mine, theirs) in enumerate(zip(planned, plans, strict=True)):
        # The owner is not compared: it is the module's name relative to the outermost
        # fully_shard'ed module, which fully_shard records later (a nested call's plan
        # changes owner when the root is sharded).
        found = first_difference(mine, replace(theirs, owner=mine.owner))
        if found is not None:
            where, value, expected = found
            raise ValueError(
                f"fully_shard({label!r}): the given plan differs from what this call plans, "
                f"group {index} ({mine.storage_dtype}), field {_named(where, mine)}: planned "
                f"{value!r}, given {expected!r}"
            )
