"""Expert parallelism in the main job: each MoE layer's experts split over the ``ep`` axis
carved from the FSDP shard axis (``hp_dtensor.parallel.ExpertParallel``), tokens sent to
their experts' ranks and back by all-to-all, uneven loads as they come.

Gradient scale, why the factors below are what they are. The trainer's loss on every rank is
its local token mean, and FSDP averages gradients over the ``D = dp_replicate x dp_shard``
data-parallel ranks: the global loss is the mean of the local ones.

* Experts: the all-to-all's backward brings every ep peer's gradient contributions to the
  rank holding the expert, so a rank's expert gradient is the sum over its ep group. FSDP
  shards the experts over the ``D / ep`` ranks holding the same ones (``expert_dp_mesh``) and
  must divide the sum of those by ``D``, not by its own size: hp-fsdp divides every group's
  gradients by the root's factor, by default the size of the root's (dense) mesh, ``D``.
* Router and shared experts: replicated over ep; the expert-parallel plan records a sum over
  ep for them (each rank's contribution is its own tokens'), which FSDP performs (an extra
  all-reduce over ep of their tail of the flat buffer) before its reduce-scatter over the
  same ``expert_dp_mesh``: the sum of all ``D`` ranks' contributions, divided by ``D`` as
  well. The whole MoE is one FSDP group (the expert-parallel forward reads the router's and
  the experts' parameters directly, so their own modules never run a forward that would
  gather them).
* The load-balancing loss: under expert parallelism each rank adds its additive share of
  the ep group's loss (global expert counts, its own scores), where without it each rank adds
  a whole loss of its own tokens; the coefficient is scaled by ``ep`` so that the two weigh
  the same after the averaging (with ``ep`` equal to every data-parallel rank, the result is
  the single-device loss of the whole batch).
"""

from __future__ import annotations

from typing import Any

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ExpertParallel, MoE, parallelize_module
from hp_fsdp import fully_shard
from hp_train.model import Transformer

__all__ = ["EP_AXIS", "apply_expert_parallel", "moe_layers", "shard_experts"]

#: The name of the expert-parallel axis (``hp_train.parallelize.build_layout``).
EP_AXIS = "ep"


def moe_layers(model: Transformer) -> dict[str, MoE]:
    """The MoE feed-forwards of ``model`` by block index."""
    return {i: b.ffn for i, b in model.layers.items() if isinstance(b.ffn, MoE)}


def apply_expert_parallel(model: Transformer, expert_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the ``ep`` axis of ``expert_mesh`` (production
    mode) and scale its load-balancing coefficient by ``ep`` (module docstring). Not with
    ``tp > 1`` (``hp_train.combinations``)."""
    ep = expert_mesh.size(EP_AXIS)
    for moe in moe_layers(model).values():
        # Only the MoE: the rest of the model keeps the tensor-parallel plan's layouts. No data
        # axis here: FSDP reduces over those.
        parallelize_module(
            moe, expert_mesh, {"": ExpertParallel()}, mode="production", tp_axis=EP_AXIS, dp_axes=()
        )
        moe.aux_loss_coef *= ep


def shard_experts(model: Transformer, expert_dp_mesh: DeviceMesh, **fsdp: Any) -> list[Any]:
    """An FSDP group over ``expert_dp_mesh`` for every MoE layer (experts, router, shared
    experts), to be made before the block's group (module docstring: their gradients are
    divided by the root's factor, ``D``)."""
    return [fully_shard(moe, mesh=expert_dp_mesh, **fsdp) for moe in moe_layers(model).values()]
