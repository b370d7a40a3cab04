"""``hyper_parallel.core.dtensor.placement_types``: the placements (hp-layout's, as hp-dtensor
uses them)."""

from hp_dtensor import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
