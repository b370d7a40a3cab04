"""``hyper_parallel.core.shard``: upstream's general sharding (:func:`shard_module` with a
:class:`ShardingPlan`)."""

from hyper_parallel.core.shard.api import shard_module
from hyper_parallel.core.shard.sharding_plan import ShardingPlan

__all__ = ["ShardingPlan", "shard_module"]
