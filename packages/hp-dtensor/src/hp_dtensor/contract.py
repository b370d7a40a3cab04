"""The one cross-package contract: what other packages learn from, and record on, a tensor or a
module that hp-dtensor (or a sharder above it) laid out.

Packages above hp-dtensor (hp-fsdp, hp-muon, hp-mpmd, hp-offload, hp-train) use these functions
and never a private attribute or a private module of hp-dtensor (``tools/check_dag.py``
enforces it). ``docs/architecture.md`` describes the plan's life cycle.

* :func:`layout_of`, :func:`annotate_layout`: a tensor's layout (our DTensor, a production-mode
  parameter, a torch DTensor, a plain tensor), and marking a plain tensor as a rank's shard.
* :func:`grad_reduction_of`: the reduction a tensor-parallel plan recorded for a parameter's
  gradient (the axes a sharder that takes over the parameter must still reduce over);
  :func:`hand_over_grad_reduction`: a sharder that took the parameter over says so, and the
  tensor-parallel executor leaves its gradient alone from then on.
* :func:`set_grad_layout`: the layout a DTensor parameter's gradient has once a sharder has
  reduced it (so that ``param.grad`` reports it).
* :func:`set_materialize_target`: where ``hp_dtensor.parallel.materialize`` writes a meta
  parameter's local values (a sharder's flat storage), so deferred initialization fills the
  sharder's buffers in place.
* :func:`parallel_plan_of`, :func:`record_parallel_plan`, :func:`record_flat_slots`: the
  module's resolved :class:`~hp_dtensor.parallel.resolved.ParallelPlan`, as the tensor-parallel
  executor recorded it, with the flat-buffer slots sharders recorded on its submodules.
"""

from __future__ import annotations

from hp_dtensor.gradients import recorded_grad_layout as grad_layout_of
from hp_dtensor.gradients import set_grad_layout
from hp_dtensor.interop import annotate_layout, layout_of
from hp_dtensor.parallel._grad_reduction import (
    GradReduction,
    grad_reduction_of,
    hand_over_grad_reduction,
)
from hp_dtensor.parallel._plan_record import (
    parallel_plan_of,
    record_flat_slots,
    record_parallel_plan,
)
from hp_dtensor.parallel.init import MaterializeTarget, set_materialize_target
from hp_dtensor.parallel.resolved import ParallelPlan, ParamFlatSlot

__all__ = [
    "GradReduction",
    "MaterializeTarget",
    "ParallelPlan",
    "ParamFlatSlot",
    "annotate_layout",
    "grad_layout_of",
    "grad_reduction_of",
    "hand_over_grad_reduction",
    "layout_of",
    "parallel_plan_of",
    "record_flat_slots",
    "record_parallel_plan",
    "set_grad_layout",
    "set_materialize_target",
]
