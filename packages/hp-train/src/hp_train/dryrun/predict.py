"""The prediction a training run compares its measurements with (issue 7: within 5% at world 2
and 4).

:func:`predict_for_run` takes the run's own configuration objects and returns a
:class:`Prediction` of one rank's per-step figures, in the conventions the measuring side
already uses:

* ``bytes_by_kind[kind]``: over one optimizer step, the sum over this rank's collectives of
  that kind of ``hp_fsdp.counting.CollectiveCall.nbytes`` (the unsharded side: an all-gather's
  output, a reduce-scatter's input, an all-reduce's tensor). For ``"muon"``: per all-to-all, the
  larger of this rank's send and receive buffers.
* ``sent_bytes_by_kind[kind]``: bytes this rank sends (ring model for FSDP/HSDP/TP; for
  ``"muon"`` exactly ``hp_muon.Muon.last_step_stats.bytes_sent``).
* ``calls_by_kind[kind]``: collectives issued (``"muon"``: ``last_step_stats.collectives``).

Kinds: ``"fsdp_all_gather"`` (forward gathers of every group, backward re-gathers of every
block: the root keeps its parameters), ``"fsdp_reduce_scatter"`` (one per group),
``"hsdp_all_reduce"`` (one per group's chunk over ``dp_replicate``), ``"tp"`` (the boundary
collectives of the trainer's resolved plan: the row-parallel all-reduces, the head's logits
all-gather; and FSDP's tail all-reduce of tensor-parallel-replicated gradients), ``"ep"``
(:mod:`~hp_train.dryrun.expert_comm`: the routing counts' all-gather, the dispatch and
combine all-to-alls both ways, FSDP's all-reduce over ep of the router's and shared experts'
gradients), ``"cp"`` (:mod:`~hp_train.dryrun.context_comm`: ring passes, both buffers of
each, or Ulysses' all-to-alls), ``"muon"`` (the owner exchanges). A degree of 1 issues no
collective of its kind (hp_fsdp copies instead).

Assumed run (what ``hp_train``'s loop does): one ``fully_shard`` per block then the root (an
MoE layer's own before its block's under expert parallelism), the train config's
checkpointing policy, no mixed precision (fp32 everywhere), its ``grad_accum`` micro-steps,
Muon with its default 32 MiB buckets on the world group. Expert all-to-alls depend on where
the router sends the tokens: ``expert_imbalance`` states this rank's rows received over rows
sent (1: balanced).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hp_layout import Topology
from hp_planner.price import (
    DEVICE_PRESETS,
    MemoryBreakdown,
    Precision,
    PricingError,
    RankGrid,
    StepShape,
    dry_run,
    precision_of,
)
from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
from hp_train.dryrun.trainer_model import TrainerModel

__all__ = ["PREDICTED_KINDS", "Prediction", "predict_for_run"]

PREDICTED_KINDS = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "hsdp_all_reduce",
    "tp",
    "ep",
    "cp",
    "muon",
)


@dataclass(frozen=True)
class Prediction:
    """One rank's predicted per-step figures (see the module doc for the conventions).

    Attributes:
        rank: the global rank.
        world_size: ranks in the run.
        param_bytes: this rank's sharded parameter storage: the sum over FSDP groups of
            ``chunk_numel x itemsize`` (hp_fsdp's ``sharded_flat`` buffers, padding included).
        param_elements: elements of this rank's parameter pieces (padding excluded): the sum
            of ``p.numel()`` over the module's sharded parameters.
        grad_bytes: this rank's reduced gradient chunks, ``sum(chunk_numel) x itemsize``
            (after backward, before ``zero_grad``).
        optimizer_state_bytes: all optimizer state tensors of this rank: Muon momentum
            (``muon_state_bytes``) plus AdamW's ``exp_avg``, ``exp_avg_sq`` and 4-byte ``step``
            (``adamw_state_bytes``), after the first step.
        muon_state_bytes: Muon's momentum buffers.
        adamw_state_bytes: AdamW's state.
        bytes_by_kind: per step, by kind (:data:`PREDICTED_KINDS`), unsharded-side bytes.
        sent_bytes_by_kind: per step, by kind, bytes this rank sends.
        calls_by_kind: per step, by kind, collectives issued.
        muon_source: ``"plan"`` (hp_muon's real plan), ``"analytic"`` or ``"none"``.
        memory: the rank's memory breakdown; ``memory.total`` is the predicted peak of the
            bytes its tensors hold during a step.
    """

    rank: int
    world_size: int
    param_bytes: int
    param_elements: int
    grad_bytes: int
    optimizer_state_bytes: int
    muon_state_bytes: int
    adamw_state_bytes: int
    bytes_by_kind: Mapping[str, int]
    sent_bytes_by_kind: Mapping[str, int]
    calls_by_kind: Mapping[str, int]
    muon_source: str
    memory: MemoryBreakdown


def predict_for_run(
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    train_config: TrainConfig,
    *,
    rank: int = 0,
    topology: Topology | None = None,
    precision: Precision | None = None,
    expert_imbalance: float = 1.0,
) -> Prediction:
    """Predict ``rank``'s memory and per-step communication for a training run.

    ``topology`` defaults to one host of the world's ranks (it affects only times, which the
    prediction does not report). ``precision`` defaults to the run's own
    (``train_config.mixed_precision`` and ``grad_reduce_dtype``); its offload and FP8 options
    are the run's too.

    Postconditions: every kind of :data:`PREDICTED_KINDS` is a key of the three maps;
    ``optimizer_state_bytes == muon_state_bytes + adamw_state_bytes``.

    Raises:
        PricingError: ``pp > 1`` (these per-rank figures are those of a run without
            pipelining; :func:`~hp_train.dryrun.dry_run` models ``pp > 1``), or any input the
            dry run refuses (indivisible batch, ``tp`` not dividing the heads, a bad rank).
    """
    if parallel_config.pp != 1:
        raise PricingError(
            f"predict_for_run predicts a run without pipeline parallelism; got "
            f"pp={parallel_config.pp} (use hp_planner.price.dry_run to model pp > 1)"
        )
    topo = topology or Topology.single_host(parallel_config.world_size)
    shape = StepShape(
        global_batch=train_config.global_batch,
        seq_len=train_config.seq_len,
        microbatches=train_config.grad_accum,
        ac=train_config.ac,
        optimizer=train_config.optimizer,
        precision=precision
        or precision_of(train_config.mixed_precision, train_config.grad_reduce_dtype),
        offload=train_config.offload,
        fp8=train_config.fp8,
        fp8_all_gather=train_config.fp8_all_gather,
        prefetch=False,
        expert_imbalance=expert_imbalance,
        swap=train_config.swap,
    )
    run = dry_run(
        TrainerModel(model_config),
        parallel_config,
        topo,
        shape,
        device=DEVICE_PRESETS["cpu"],
        rank=rank,
    )
    stage = run.stages[0]
    memory = stage.memory
    coord = RankGrid.build(parallel_config, topo).coordinate(rank)
    elements = sum(
        sum(g.local_numels(coord["expert_shard"] if g.is_experts else coord["fsdp"]))
        for g in stage.groups
    )
    kinds = {k.kind: k for k in run.kinds}
    return Prediction(
        rank=rank,
        world_size=parallel_config.world_size,
        param_bytes=memory.parameters,
        param_elements=elements,
        grad_bytes=memory.gradients,
        optimizer_state_bytes=memory.optimizer,
        muon_state_bytes=memory.muon_state,
        adamw_state_bytes=memory.optimizer - memory.muon_state,
        bytes_by_kind={k: kinds[k].nbytes for k in PREDICTED_KINDS},
        sent_bytes_by_kind={k: kinds[k].sent_bytes for k in PREDICTED_KINDS},
        calls_by_kind={k: kinds[k].calls for k in PREDICTED_KINDS},
        muon_source=stage.muon.source,
        memory=memory,
    )
