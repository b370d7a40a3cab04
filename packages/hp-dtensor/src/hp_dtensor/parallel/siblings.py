"""The plan check that needs the styles: look-alike sibling projections sharded alike.

It lives apart from :mod:`hp_dtensor.parallel.plan` because it asks whether a module's style
is :class:`~hp_dtensor.parallel.styles.ColwiseParallel`, and ``styles`` imports ``plan``: kept
here, the dependency goes one way (``siblings`` -> ``styles`` -> ``plan``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hp_dtensor.parallel.plan import PlanError, ShardingPlan
from hp_dtensor.parallel.styles import ColwiseParallel

__all__ = ["check_sibling_projections"]


def check_sibling_projections(
    module: nn.Module, lowered: Sequence[tuple[str, ShardingPlan]]
) -> None:
    """Refuse a plan that shards some of a module's look-alike projections but not all.

    Linear layers of one parent with the same input and output features that read the same
    input are the q/k/v or gate/up projections of a block; sharding one column-wise and leaving
    a twin out of the plan gives a replicated output beside sharded ones, which production mode
    would combine without any shape error (under grouped-query attention the head counts still
    broadcast) and train on silently. A twin that must stay replicated says so with an empty
    ``ShardingPlan()`` entry.

    Raises:
        PlanError: naming the unplanned twin and its column-parallel sibling.
    """
    styles = dict(lowered)
    for parent_name, parent in module.named_modules():
        linears = {
            f"{parent_name}.{n}" if parent_name else n: child
            for n, child in parent.named_children()
            if isinstance(child, nn.Linear)
        }
        column = [
            n
            for n in linears
            if isinstance(styles.get(n, ShardingPlan()).behaviour, ColwiseParallel)
        ]
        for name, linear in linears.items():
            if name in styles:
                continue
            for sharded in column:
                twin = linears[sharded]
                if (twin.in_features, twin.out_features) == (
                    linear.in_features,
                    linear.out_features,
                ):
                    raise PlanError(
                        f"module {name!r} (Linear {linear.in_features} -> "
                        f"{linear.out_features}) is not in the plan, but its twin {sharded!r} "
                        "is ColwiseParallel: its output would stay replicated beside sharded "
                        f"ones; add ColwiseParallel() for {name!r}, or ShardingPlan() to keep "
                        "it replicated on purpose"
                    )
