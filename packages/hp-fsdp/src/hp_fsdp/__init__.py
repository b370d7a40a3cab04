"""hp_fsdp: topology-aware fully sharded data parallel with zero-copy flat buffers."""

from hp_fsdp.api import FSDPModule, fully_shard
from hp_fsdp.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "__version__",
    "fully_shard",
]
