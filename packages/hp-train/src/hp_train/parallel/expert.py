"""Expert parallelism in the main job: each MoE layer's experts split over the ``ep`` axis
carved from the FSDP shard axis (``dp_shard``, ``dp_shard x cp`` under context parallelism:
the MoE is token-wise, so a context-parallel rank's columns route like any other tokens;
``hp_dtensor.parallel.ExpertParallel``), tokens sent to their experts' ranks and back by
all-to-all, uneven loads as they come.

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
  the same after the averaging (with ``ep`` equal to every data-parallel rank, times ``cp``
  under context parallelism, the result is the single-device loss of the whole batch: FSDP
  averages over ``dp_shard x cp``, each rank's loss the mean of its equal share of tokens).

With tensor parallelism. The dense parts' gradients follow the adjoint convention over
``tp`` (each tp rank's activation gradients are partial, replicated parameters summed over
``tp``), the expert-parallel forward the exact one (every tp rank's gradient whole). Each
MoE therefore runs in an exact region (``hp_dtensor.parallel.run_in_exact_region``): its
output's gradient is all-reduced over ``tp`` before its backward, its input's gradient goes
back whole on tp rank 0 and zero on the others. Its parameters then need no sum over ``tp``:
the experts are whole on every tp rank (``ExpertParallel``, computed ``tp`` times) or split
over it (``--ep-tp``: ``ExpertTensorParallel``), router and shared experts get the whole
gradient on each. Without expert parallelism the MoE is one more replicated part of the
tensor-parallel model (adjoint, summed over ``tp`` with the norms); only its load-balancing
loss, the same on every tp rank, is seeded on one of them (:func:`seed_aux_loss_once`).

Under pipelining. Each stage's MoE layers attach their load-balancing losses to their own
outputs, so an earlier stage's term gets its gradient when the next stage's input gradient
comes back through it: no backward of its own is needed. The schedule scales each
microbatch's language-model loss by ``1 / microbatches`` (the gradients of the step's mean
loss); the load-balancing terms are scaled alike (:func:`scale_aux_gradient`), so a pipelined
step has the gradients of the same step in ``microbatches`` accumulation micro-steps.
"""

from __future__ import annotations

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    ParallelStyle,
    parallelize_module,
    run_in_exact_region,
)
from hp_train.model.llama import Transformer
from hp_train.model.moe import MoE

__all__ = [
    "EP_AXIS",
    "apply_expert_parallel",
    "moe_layers",
    "scale_aux_gradient",
    "seed_aux_loss_once",
]

#: The name of the expert-parallel axis (``hp_train.parallel.parallelize.build_layout``).
EP_AXIS = "ep"
_TP_AXIS = "tp"


def moe_layers(model: Transformer) -> dict[str, MoE]:
    """The MoE feed-forwards of ``model`` by block index."""
    return {i: b.ffn for i, b in model.layers.items() if isinstance(b.ffn, MoE)}


def apply_expert_parallel(
    model: Transformer, expert_mesh: DeviceMesh, *, split_experts_over_tp: bool = False
) -> None:
    """Shard every MoE layer's experts over the ``ep`` axis of ``expert_mesh`` (production
    mode), with ``split_experts_over_tp`` their hidden dims over its ``tp`` axis too; scale
    the load-balancing coefficient by ``ep``; with ``tp > 1`` run each MoE in an exact
    region over ``tp`` (module docstring)."""
    ep, tp = expert_mesh.size(EP_AXIS), expert_mesh.size(_TP_AXIS)
    style: ParallelStyle = ExpertParallel()
    if split_experts_over_tp:
        style = ExpertTensorParallel(
            mesh_axes=tuple(expert_mesh.mesh_dim_names), ep_axis=EP_AXIS, tp_axis=_TP_AXIS
        )
    for moe in moe_layers(model).values():
        # Only the MoE: the rest of the model keeps the tensor-parallel plan's layouts. No data
        # axis here: FSDP reduces over those.
        parallelize_module(
            moe, expert_mesh, {"": style}, mode="production", tp_axis=EP_AXIS, dp_axes=()
        )
        moe.aux_loss_coef *= ep
        if tp > 1:
            run_in_exact_region(moe, expert_mesh, _TP_AXIS)


def seed_aux_loss_once(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Without expert parallelism, under ``tp > 1``: seed each MoE's load-balancing loss on
    tp rank 0 only (module docstring)."""
    if tp_mesh.size(_TP_AXIS) == 1:
        return
    first = tp_mesh.get_local_rank(_TP_AXIS) == 0
    for moe in moe_layers(model).values():
        moe.aux_grad_seed = 1.0 if first else 0.0


def scale_aux_gradient(model: Transformer, factor: float) -> None:
    """Scale every MoE layer's load-balancing gradient by ``factor`` (``MoE.aux_grad_scale``;
    under pipelining ``1 / microbatches``: module docstring), whatever seed its forward gives
    (:func:`seed_aux_loss_once`'s, or the expert-parallel forward's).

    Raises:
        ValueError: ``factor`` is not a positive finite number.
    """
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise ValueError(f"the aux-loss gradient factor must be a number, got {factor!r}")
    if not 0.0 < factor < float("inf"):
        raise ValueError(f"the aux-loss gradient factor must be positive and finite, got {factor}")
    for moe in moe_layers(model).values():
        moe.aux_grad_scale = float(factor)
