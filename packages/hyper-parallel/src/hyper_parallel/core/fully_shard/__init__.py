"""``hyper_parallel.core.fully_shard``: :func:`fully_shard` and its policies (hp-fsdp's)."""

from hp_fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.api import fully_shard

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard"]
