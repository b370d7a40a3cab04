"""Sharding rules, registered on import (one module per family of ops)."""

from hp_dtensor.rules import (
    contraction,
    factories,
    indexing,
    losses,
    nn,
    pointwise,
    reductions,
    scans,
    scatter,
    selection,
    views,
)
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
    rule_for,
)

__all__ = [
    "OpCall",
    "ShardingDecision",
    "ShardingRuleError",
    "contraction",
    "factories",
    "indexing",
    "losses",
    "nn",
    "pointwise",
    "reductions",
    "register_sharding_rule",
    "rule_for",
    "scans",
    "scatter",
    "selection",
    "views",
]
