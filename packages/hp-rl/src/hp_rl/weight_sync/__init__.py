"""The weight sync from the training layout to the rollout layout: planned once by hp-layout
(:mod:`hp_rl.weight_sync.plan`), run all or nothing (:mod:`hp_rl.weight_sync.execute`), set up
collectively (:mod:`hp_rl.weight_sync.connect`)."""

from hp_rl.weight_sync.connect import SyncMismatchError, connect_weight_sync
from hp_rl.weight_sync.execute import SyncFailedError, SyncResult, WeightSync
from hp_rl.weight_sync.plan import METHODS, Route, SyncPlan, plan_sync

__all__ = [
    "METHODS",
    "Route",
    "SyncFailedError",
    "SyncMismatchError",
    "SyncPlan",
    "SyncResult",
    "WeightSync",
    "connect_weight_sync",
    "plan_sync",
]
