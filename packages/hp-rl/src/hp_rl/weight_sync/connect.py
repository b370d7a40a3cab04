"""Set up the weight sync between a laid-out policy and a rollout model: the job agrees on
every tensor's two layouts, plans once, and each rank builds its executor.

A rank knows the layouts of the models it holds only (a disaggregated job's training ranks
hold no rollout model), so every rank contributes what it holds and every rank plans from the
union: all ranks hold the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hp_layout import Layout, Topology
from hp_rl.weight_sync.execute import WeightSync
from hp_rl.weight_sync.plan import Route, plan_sync
from hp_train.objects import gather_objects

__all__ = ["SyncMismatchError", "connect_weight_sync"]


class SyncMismatchError(ValueError):
    """The training and rollout models do not hold the same tensors."""


@dataclass(frozen=True)
class _Held:
    """What one rank holds of one side: each tensor's layout and item size."""

    tensors: dict[str, tuple[Layout, int]]


#: One side of the sync on this rank: name -> (global layout, this rank's local tensor).
Held = Mapping[str, tuple[Layout, torch.Tensor]]


def _held(tensors: Held | None) -> _Held | None:
    if tensors is None:
        return None
    return _Held({n: (layout, t.element_size()) for n, (layout, t) in tensors.items()})


def _first(values: list[object]) -> _Held:
    for value in values:
        if isinstance(value, _Held):
            return value
    raise SyncMismatchError("no rank holds this side of the weight sync")


def connect_weight_sync(
    policy: Held | None,
    rollout: Held | None,
    *,
    method: str = "direct",
    topology: Topology | None = None,
    what: str = "policy",
) -> WeightSync:
    """This rank's executor of the sync from ``policy`` (the laid-out training model's
    tensors, :func:`hp_rl.models.local_layouts`; None on a rank that does not train) to
    ``rollout`` (the rollout engine's tensors, :meth:`hp_rl.engine.RolloutEngine.tensors`;
    None on a rank that does not roll out). Collective over the job. ``what`` names the pair
    in errors and watch names.

    Raises:
        SyncMismatchError: the two sides hold different tensors, or one tensor in two dtypes.
    """
    gathered = gather_objects((_held(policy), _held(rollout)), f"weight sync layouts ({what})")
    pairs = [p for p in gathered if isinstance(p, tuple)]
    src = _first([p[0] for p in pairs]).tensors
    dst = _first([p[1] for p in pairs]).tensors
    if set(src) != set(dst):
        raise SyncMismatchError(
            f"{what}: training and rollout models hold different tensors (only in training: "
            f"{sorted(set(src) - set(dst))[:5]}; only in the rollout model: "
            f"{sorted(set(dst) - set(src))[:5]})"
        )
    routes = []
    for name in sorted(src):
        (src_layout, itemsize), (dst_layout, dst_itemsize) = src[name], dst[name]
        if itemsize != dst_itemsize:
            raise SyncMismatchError(
                f"{what}: {name!r} is {itemsize}-byte elements in training and {dst_itemsize} in "
                "the rollout model; both sides must hold the same dtype (the sync copies bits)"
            )
        routes.append(Route(name, src_layout, dst_layout, itemsize))
    plan = plan_sync(routes, method, topology)
    sources = {} if policy is None else {n: t for n, (_, t) in policy.items()}
    targets = {} if rollout is None else {n: t for n, (_, t) in rollout.items()}
    return WeightSync(plan, sources, targets)
