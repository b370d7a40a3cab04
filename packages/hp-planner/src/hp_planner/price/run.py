"""The dry run: memory, communication and step time of one configuration, without processes.

Schedule model (per microbatch, on each pipeline stage; stated so its numbers can be checked):

* **FSDP collectives** follow the runtime's own order (:mod:`~hp_planner.price.runtime_order`):
  each ``fully_shard`` state's all-gather, prefetch, reshard, reduce-scatter and replicate
  all-reduce issued and waited for where hp-fsdp (or the modeled torch FSDP2 or Megatron DDP)
  issues and waits for them, nested expert groups included, simulated with one stream per
  topology tier beside the compute stream (:mod:`~hp_planner.price.timeline`). The replicas'
  all-reduce runs on the last microbatch of a step (torch FSDP2: on every one); what that
  microbatch takes beyond the others is the step's once-per-step exposed time.
* **Tensor, expert and context parallel** collectives (:mod:`~hp_planner.price.expert_comm`,
  :mod:`~hp_planner.price.context_comm`), pipeline sends and Muon's exchange are on the
  critical path (fully exposed): the runtime waits on each before computing on its result.
  Newton-Schulz runs on the owners after the exchange. The tensor-parallel activation
  collectives are those of the model's resolved plan
  (:func:`~hp_planner.price.structure.tp_collectives`), each of one microbatch's activation
  (``tokens x dim``), the head's of its logits; every recomputing policy runs the blocks'
  forward collectives again.
* **Pipeline**: the schedule (``1f1b`` or ``gpipe``) built and timed by hp-mpmd
  (:mod:`~hp_planner.price.schedule`), every stage at the slowest stage's forward and backward
  microbatch times; stages keep the blocks the model gives them
  (``PricedModel.stage_boundaries``).
* **Activation swap** copies run on a host-link stream in the runtime's order (the swapper's
  offload at a block's forward end, its fetch at the block's backward start, one block ahead);
  the compute stream's waits for them are the step's swap time, reported with offload.

Compute time is FLOPs (:mod:`hp_planner.price.workload`) over the device's achieved
throughput, the blocks' linears ``fp8_speedup`` times faster under ``fp8``. Elementwise
optimizer work and kernel launch overheads are not modeled. The runtime's refused pairs of
options (``PricedModel.check_accepts``: a trainer's own) are refused here too (for
``runtime="hp"``: the modeled baselines are other runtimes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hp_fsdp.replicate_buckets import bucket_cap_bytes
from hp_layout import Collective, Topology
from hp_planner.inputs import JobDims
from hp_planner.price.comm import KINDS, CollectiveRecord, RankGrid
from hp_planner.price.context_comm import context_records
from hp_planner.price.devices import Device, device_for
from hp_planner.price.expert_comm import expert_records
from hp_planner.price.memory import (
    MemoryBreakdown,
    block_kept,
    fp8_record_bytes,
    memory_breakdown,
)
from hp_planner.price.model import PricedModel
from hp_planner.price.muon_traffic import (
    MuonTraffic,
    job_muon_step,
    muon_traffic,
    planned_traffic,
)
from hp_planner.price.runtime_order import (
    FORWARD_END,
    SWAP_KIND,
    Runtime,
    Unit,
    microbatch_program,
)
from hp_planner.price.schedule import in_flight, pipeline_timing
from hp_planner.price.structure import (
    GroupSpec,
    ParamSpec,
    check_fits,
    fsdp_groups,
    job_plan,
    parameter_count,
    stage_layers,
    tp_collectives,
)
from hp_planner.price.timeline import simulate
from hp_planner.price.workload import (
    Precision,
    StepShape,
    attention_forward_flops,
    block_forward_flops,
    head_forward_flops,
)

__all__ = ["DryRun", "KindSummary", "StageResult", "StepTime", "dry_run"]

_FSDP = ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce", "ddp_all_reduce")


@dataclass(frozen=True)
class KindSummary:
    """One collective kind over a step on one rank.

    Attributes:
        kind: one of :data:`hp_planner.price.comm.KINDS`.
        calls: collectives issued.
        nbytes: bytes, unsharded-side convention (:mod:`hp_planner.price.comm`).
        sent_bytes: bytes this rank sends.
        time: seconds of communication.
        exposed: seconds not hidden behind compute under the schedule model.
        by_tier: ``(tier, sent_bytes, seconds)`` per tier used.
    """

    kind: str
    calls: int
    nbytes: int
    sent_bytes: int
    time: float
    exposed: float
    by_tier: tuple[tuple[str, int, float], ...]


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest stage.

    Attributes:
        compute: forward, backward and recomputation over all microbatches.
        exposed_comm: communication not hidden, over all microbatches (FSDP, HSDP, TP, EP,
            CP, PP).
        bubble: pipeline idle time of the schedule (hp-mpmd's simulator).
        optimizer: Muon's exchange and Newton-Schulz.
        fsdp_comm: time of all FSDP and HSDP collectives (hidden or not).
        fsdp_exposed: their exposed part.
        offload: host transfers of offloading (taken as exposed) and the waits for
            activation swap copies.
    """

    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    fsdp_comm: float
    fsdp_exposed: float
    offload: float = 0.0

    @property
    def total(self) -> float:
        """Seconds per step."""
        return self.compute + self.exposed_comm + self.bubble + self.optimizer + self.offload

    @property
    def fsdp_fraction(self) -> float:
        """FSDP communication time (hidden or not) as a fraction of the step."""
        return self.fsdp_comm / self.total if self.total else 0.0

    @property
    def fsdp_exposed_fraction(self) -> float:
        """Exposed FSDP communication as a fraction of the step."""
        return self.fsdp_exposed / self.total if self.total else 0.0


@dataclass(frozen=True)
class StageResult:
    """One pipeline stage, seen from one of its ranks.

    Attributes:
        stage: the stage index.
        rank: the rank the figures are for.
        layers: ``[start, stop)`` of its blocks.
        groups: its FSDP groups at that rank's tensor-parallel coordinate.
        memory: that rank's memory.
        records: its collectives of one step.
        muon: its Muon exchange.
        microbatch_compute: seconds of compute per microbatch.
        microbatch_exposed: exposed communication seconds per microbatch.
        exposed_by_kind: ``(kind, seconds)`` exposed per step.
        microbatch_forward: seconds of one microbatch's forward (compute and exposed
            communication; the rest of :attr:`microbatch_time` is its backward).
        offload_time: seconds of host transfers per step.
        step_exposed: exposed seconds once per step (the replicas' all-reduce).
        fsdp_overhead: seconds per step of copies around the FSDP collectives (torch
            FSDP2's copy-in and copy-out; none for hp-fsdp).
        fsdp_units: its ``fully_shard`` states with their collectives and compute, the tree
            :func:`~hp_planner.price.runtime_order.microbatch_program` orders.
        microbatch_swap_exposed: the part of :attr:`microbatch_exposed` that waits for
            activation swap copies (host transfers, not communication).
    """

    stage: int
    rank: int
    layers: tuple[int, int]
    groups: tuple[GroupSpec, ...]
    memory: MemoryBreakdown
    records: tuple[CollectiveRecord, ...]
    muon: MuonTraffic
    microbatch_compute: float
    microbatch_exposed: float
    exposed_by_kind: tuple[tuple[str, float], ...]
    microbatch_forward: float = 0.0
    offload_time: float = 0.0
    step_exposed: float = 0.0
    fsdp_overhead: float = 0.0
    fsdp_units: Unit | None = None
    microbatch_swap_exposed: float = 0.0

    @property
    def microbatch_time(self) -> float:
        """Seconds per microbatch (compute plus exposed communication)."""
        return self.microbatch_compute + self.microbatch_exposed


@dataclass(frozen=True)
class DryRun:
    """The prediction for one configuration.

    Attributes:
        model_name: a label.
        model: the model.
        parameters: its parameter count.
        parallel: the degrees.
        topology: the topology's name.
        device: the device model.
        shape: the step's shape and options.
        microbatch_size: sequences per microbatch per data-parallel rank.
        stages: one result per evaluated pipeline stage (all of them by default).
        memory: the memory of the stage that needs the most (the one that must fit).
        kinds: per collective kind, summed over the step, on the slowest stage's rank.
        time: the step time.
        notes: caveats of this prediction (modeled-only features, Muon's source).
    """

    model_name: str
    model: PricedModel
    parameters: int
    parallel: JobDims
    topology: str
    device: Device
    shape: StepShape
    microbatch_size: int
    stages: tuple[StageResult, ...]
    memory: MemoryBreakdown
    kinds: tuple[KindSummary, ...]
    time: StepTime
    notes: tuple[str, ...]

    def kind(self, name: str) -> KindSummary:
        """The summary of collective kind ``name``."""
        for k in self.kinds:
            if k.kind == name:
                return k
        raise KeyError(f"no collective kind {name!r}; kinds are {list(KINDS)}")


def _local_param(p: ParamSpec, shape: tuple[int, ...]) -> ParamSpec:
    return ParamSpec(p.name, shape, p.optimizer, p.tp_dim)


_MUON_GROUPS: dict[int, tuple[tuple[GroupSpec, ...], tuple[GroupSpec, ...]]] = {}


def _muon_groups(groups: tuple[GroupSpec, ...]) -> tuple[GroupSpec, ...]:
    """``groups`` with each expert group's parameters at their local (``n_experts / ep``)
    shapes, the matrices Muon sees on the rank (cached by identity: ``fsdp_groups`` is)."""
    cached = _MUON_GROUPS.get(id(groups))
    if cached is not None and cached[0] is groups:
        return cached[1]
    if not any(g.is_experts for g in groups):
        return groups
    out = []
    for g in groups:
        if g.is_experts:
            params = tuple(
                _local_param(p, s) for p, s in zip(g.params, g.local_shapes, strict=True)
            )
            g = replace(g, params=params)
        out.append(g)
    _MUON_GROUPS[id(groups)] = (groups, tuple(out))
    return _MUON_GROUPS[id(groups)][1]


_MUON_TRAFFIC: dict[tuple[object, ...], tuple[tuple[GroupSpec, ...], MuonTraffic]] = {}


def _muon_traffic(
    groups: tuple[GroupSpec, ...],
    parallel: JobDims,
    rank: int,
    bucket_mb: float,
    exact: bool | None,
    planned: Callable[[], MuonTraffic],
) -> MuonTraffic:
    """:func:`muon_traffic` of ``groups`` (by identity, as :func:`_muon_groups`): the search
    asks for the same stage's traffic once per microbatch count and policy, and it depends
    on neither."""
    key = (id(groups), parallel, rank, bucket_mb, exact)
    cached = _MUON_TRAFFIC.get(key)
    if cached is not None and cached[0] is groups:
        return cached[1]
    traffic = muon_traffic(
        _muon_groups(groups),
        parallel,
        rank=rank,
        bucket_mb=bucket_mb,
        exact=exact,
        planned=planned,
    )
    _MUON_TRAFFIC[key] = (groups, traffic)
    return traffic


@dataclass(frozen=True)
class _StageCompute:
    """Seconds of one microbatch's compute on a stage: per block (keyed by block index), the
    head's and the whole microbatch's.

    Attributes:
        forward: each block's forward (its linears ``fp8_speedup`` times faster under FP8).
        attention: the part of ``forward`` before an MoE layer's experts (its attention).
        recompute: the share of each block's forward run again in backward.
        swap: seconds one way of each block's swapped activations over the host link.
        head: the head's forward (0 off the last stage).
        microbatch: forward, backward (twice the forward) and recomputation of a microbatch.
    """

    forward: Mapping[int, float]
    attention: Mapping[int, float]
    recompute: Mapping[int, float]
    swap: Mapping[int, float]
    head: float
    microbatch: float

    @property
    def forward_total(self) -> float:
        """The blocks' and the head's forward."""
        return sum(self.forward.values()) + self.head


def _stage_compute(
    model: PricedModel,
    shape: StepShape,
    device: Device,
    p: JobDims,
    blocks: Sequence[int],
    tokens: int,
    *,
    last: bool,
) -> _StageCompute:
    """FLOPs over the device's throughput of ``tokens`` tokens through ``blocks`` (and the
    head when ``last``), what each block recomputes under ``shape``'s policy and what it swaps.
    The attention scores' FLOPs are never FP8."""
    flops = device.flops
    speed = device.fp8_speedup if shape.fp8 != "none" else 1.0
    fwd: dict[int, float] = {}
    attention: dict[int, float] = {}
    recompute_share: dict[int, float] = {}
    redo: dict[int, float] = {}
    swap: dict[int, float] = {}
    dims = model.shape
    for b in blocks:
        total = block_forward_flops(
            dims,
            b,
            p.tp,
            shape.seq_len,
            ep_tp=p.ep_tp,
            expert_imbalance=shape.expert_imbalance if p.ep > 1 else 1.0,
        )
        scores = 2 * shape.seq_len * dims.n_heads * dims.head_dim / p.tp
        fwd[b] = ((total - scores) / speed + scores) * tokens / flops
        attn = attention_forward_flops(dims, p.tp, shape.seq_len)
        attention[b] = ((attn - scores) / speed + scores) * tokens / flops
        kept = block_kept(dims, b, tokens, shape, p)
        recompute_share[b] = kept.recompute_fraction
        redo[b] = recompute_share[b] * fwd[b]
        swap[b] = kept.swapped / device.host_bandwidth
    head_fwd = head_forward_flops(dims, p.tp) * tokens / flops if last else 0.0
    mb_compute = 3 * (sum(fwd.values()) + head_fwd) + sum(redo.values())
    return _StageCompute(fwd, attention, recompute_share, swap, head_fwd, mb_compute)


@dataclass(frozen=True)
class _GroupCosts:
    """One FSDP group's collectives per step and its ``fully_shard`` state.

    Attributes:
        records: its collectives in the order the stage lists them (None: nothing moves).
        unit: its state with the seconds of those collectives (its forward compute is
            filled in by :func:`_unit_tree`).
        copies: torch FSDP2's copy-in and copy-out seconds per microbatch around its
            all-gather and reduce-scatter (None under the other runtimes).
    """

    records: tuple[CollectiveRecord | None, ...]
    unit: Unit
    copies: tuple[float, float] | None = None


def _ddp_group_costs(
    g: GroupSpec, grid: RankGrid, prec: Precision, tail: CollectiveRecord | None
) -> _GroupCosts:
    """Megatron DDP's gradient all-reduce of group ``g``, once per step over every
    data-parallel rank holding its parameters (after the tensor-parallel ``tail``)."""
    padded = g.flat.padded_numel
    axis = "expert_dp" if g.is_experts else "dp"
    reduce = grid.record(
        "ddp_all_reduce", Collective.ALL_REDUCE, "backward", axis, padded * prec.reduce
    )
    unit = Unit(
        g.name,
        (0.0,),
        replicate=reduce.time if reduce else 0.0,
        chunk_bytes=padded * prec.reduce,
        replicate_tier=reduce.tier if reduce else "",
    )
    return _GroupCosts((tail, reduce), unit)


def _fsdp_group_costs(
    g: GroupSpec,
    grid: RankGrid,
    shape: StepShape,
    device: Device,
    tail: CollectiveRecord | None,
) -> _GroupCosts:
    """FSDP's collectives of group ``g`` per step: its all-gather in forward, again in
    backward (not the root's), its reduce-scatter, and the replicas' all-reduce (once per
    step; torch FSDP2: once per microbatch), after the tensor-parallel ``tail``."""
    prec, m = shape.precision, shape.passes
    fsdp2 = shape.runtime == "torch_fsdp2"
    padded, chunk = g.flat.padded_numel, g.flat.chunk_numel
    # What the all-gather moves: each rank's FP8 record (data, then scales), or the shards.
    gathered = (
        padded // chunk * fp8_record_bytes(chunk)
        if shape.fp8_all_gather and chunk
        else padded * prec.compute
    )
    axis = "expert_shard" if g.is_experts else "dp_shard"
    gather = grid.record("fsdp_all_gather", Collective.ALL_GATHER, "forward", axis, gathered, m)
    regather = (
        None
        if g.is_root
        else grid.record("fsdp_all_gather", Collective.ALL_GATHER, "backward", axis, gathered, m)
    )
    scatter = grid.record(
        "fsdp_reduce_scatter", Collective.REDUCE_SCATTER, "backward", axis, padded * prec.reduce, m
    )
    reduce = grid.record(
        "hsdp_all_reduce",
        Collective.ALL_REDUCE,
        "backward",
        "dp_replicate",
        chunk * prec.reduce,
        m if fsdp2 else 1,
    )
    gather_copy = scatter_copy = 0.0
    if fsdp2:
        # Copy-in and copy-out around each collective, on the compute stream.
        move = 2 * (padded + chunk) / device.memory_bandwidth
        gather_copy = move * prec.compute if gather else 0.0
        scatter_copy = move * prec.reduce if scatter else 0.0
    unit = Unit(
        g.name,
        (0.0,),
        gather=gather.time if gather else 0.0,
        regather=regather.time if regather else 0.0,
        scatter=scatter.time if scatter else 0.0,
        replicate=reduce.time if reduce else 0.0,
        chunk_bytes=chunk * prec.reduce,
        tier=scatter.tier if scatter else (gather.tier if gather else ""),
        replicate_tier=reduce.tier if reduce else "",
        gather_copy=gather_copy,
        scatter_copy=scatter_copy,
    )
    copies = (gather_copy, scatter_copy) if fsdp2 else None
    return _GroupCosts((tail, gather, regather, scatter, reduce), unit, copies)


@dataclass(frozen=True)
class _FsdpCosts:
    """The data-parallel collectives of a stage's groups.

    Attributes:
        records: every group's (:attr:`_GroupCosts.records`), in group order.
        units: each group's ``fully_shard`` state, by group name.
        overhead: seconds per step of torch FSDP2's copies around the collectives (the
            copy-in before a block's forward all-gather counted again for its backward one).
    """

    records: tuple[CollectiveRecord | None, ...]
    units: Mapping[str, Unit]
    overhead: float


def _fsdp_costs(
    groups: tuple[GroupSpec, ...], grid: RankGrid, shape: StepShape, device: Device
) -> _FsdpCosts:
    """Each group's tensor-parallel tail all-reduce and its data-parallel collectives under
    ``shape``'s runtime (Megatron DDP: :func:`_ddp_group_costs`, else
    :func:`_fsdp_group_costs`)."""
    prec, m = shape.precision, shape.passes
    records: list[CollectiveRecord | None] = []
    units: dict[str, Unit] = {}
    copies: dict[int | None, tuple[float, float]] = {}
    for g in groups:
        tail = grid.record(
            g.tail_axis,
            Collective.ALL_REDUCE,
            "backward",
            g.tail_axis,
            (g.flat.padded_numel - g.extra_start) * prec.compute,
            m,
        )
        if shape.runtime == "megatron_ddp":
            costs = _ddp_group_costs(g, grid, prec, tail)
        else:
            costs = _fsdp_group_costs(g, grid, shape, device, tail)
        records += costs.records
        units[g.name] = costs.unit
        if costs.copies is not None:
            c_ag, c_rs = copies.get(g.block, (0.0, 0.0))
            copies[g.block] = (c_ag + costs.copies[0], c_rs + costs.copies[1])
    overhead = m * sum(a + b for a, b in copies.values())
    # A block's copy-in again before its backward all-gather (the root has none).
    overhead += m * sum(c[0] for u, c in copies.items() if u is not None)
    return _FsdpCosts(tuple(records), units, overhead)


def _tp_pp_records(
    model: PricedModel,
    grid: RankGrid,
    shape: StepShape,
    blocks: Sequence[int],
    tokens: int,
    *,
    first: bool,
    last: bool,
) -> list[CollectiveRecord | None]:
    """The step's tensor-parallel activation collectives, each of one microbatch's
    activation, by phase and collective: the blocks' (again in the recomputed forward), the
    embedding's and the head's of the logits (on the ``first`` and the ``last`` stage); then
    the pipeline sends."""
    prec, m = shape.precision, shape.passes
    act = tokens * model.shape.dim * prec.compute
    block_calls: dict[tuple[str, str], int] = {}
    for b in blocks:
        forward, backward = tp_collectives(model, f"{model.blocks}.{b}")
        for phase, kinds in (("forward", forward), ("backward", backward)):
            for kind in kinds:
                block_calls[phase, kind] = block_calls.get((phase, kind), 0) + 1
    recomputes = shape.ac != "none"
    phases = ("forward", "backward", "recompute") if recomputes else ("forward", "backward")
    tp_records = [
        grid.record("tp", Collective(kind), phase, "tp", act, n * m)
        for phase in phases
        for (of, kind), n in block_calls.items()
        if of == (phase if phase != "recompute" else "forward")
    ]
    units = ([(model.embedding, act)] if first else []) + (
        [(model.head, tokens * model.shape.vocab_size * prec.compute)] if last else []
    )
    for unit_name, nbytes in units:
        forward, backward = tp_collectives(model, unit_name)
        for phase, kinds in (("forward", forward), ("backward", backward)):
            tp_records += [grid.record("tp", Collective(k), phase, "tp", nbytes, m) for k in kinds]
    if grid.parallel.pp > 1:
        if not last:
            tp_records.append(grid.record("pp", Collective.SEND_RECV, "forward", "pp", act, m))
        if not first:
            tp_records.append(grid.record("pp", Collective.SEND_RECV, "backward", "pp", act, m))
    return tp_records


def _model_parallel_records(
    model: PricedModel,
    grid: RankGrid,
    shape: StepShape,
    blocks: Sequence[int],
    tokens: int,
    *,
    first: bool,
    last: bool,
) -> list[CollectiveRecord | None]:
    """The stage's critical-path collectives of a step: tensor-parallel and pipeline
    (:func:`_tp_pp_records`), then expert- and context-parallel."""
    prec, m = shape.precision, shape.passes
    recomputes = shape.ac != "none"
    moe = model.shape.moe
    moe_layers = sum(1 for b in blocks if moe is not None and moe.is_moe_layer(b))
    records = _tp_pp_records(model, grid, shape, blocks, tokens, first=first, last=last)
    records += expert_records(
        model.shape,
        grid,
        moe_layers,
        tokens,
        prec.compute,
        microbatches=m,
        imbalance=shape.expert_imbalance,
        recompute=recomputes,
    )
    records += context_records(
        model.shape, grid, len(blocks), tokens, prec.compute, microbatches=m, recompute=recomputes
    )
    return records


def _stage_muon(
    model: PricedModel,
    groups: tuple[GroupSpec, ...],
    p: JobDims,
    shape: StepShape,
    stage: int,
    rank: int,
    muon_exact: bool | None,
) -> MuonTraffic:
    """Muon's exchange over the stage's ranks (none under AdamW); estimated, never planned,
    with expert parallelism and under Megatron's DDP (whose whole replicas no JobPlan
    describes). The exact figures are the trainer's JobPlan's Muon step of ``rank``
    (:func:`~hp_planner.price.muon_traffic.job_muon_step`)."""
    stage_parallel = JobDims(p.dp_replicate, p.dp_shard * p.cp, p.tp, 1)
    stage_rank = rank - stage * stage_parallel.world_size
    if shape.optimizer != "muon":
        return MuonTraffic("none", 0, 0, 0, 0, 0, 0, 0.0)

    def planned() -> MuonTraffic:
        plan = job_plan(
            model, p, param_bytes=shape.precision.param, ranks=frozenset({rank}), muon=True
        )
        step = job_muon_step(plan, rank, shape.muon_bucket_mb)
        return planned_traffic(step, rank, stage_parallel.dp_shard * p.tp)

    return _muon_traffic(
        groups,
        stage_parallel,
        stage_rank,
        shape.muon_bucket_mb,
        False if p.ep > 1 or shape.runtime == "megatron_ddp" else muon_exact,
        planned,
    )


@dataclass(frozen=True)
class _Exposure:
    """What of a stage's communication the compute does not hide.

    Attributes:
        forward: seconds of one microbatch's forward, compute and exposed communication.
        microbatch: exposed seconds per microbatch (swap waits included).
        swap: the part of ``microbatch`` that waits for activation swap copies.
        step: exposed seconds once per step (the last microbatch's replicas' all-reduce).
        by_kind: ``(kind, seconds)`` exposed per step.
    """

    forward: float
    microbatch: float
    swap: float
    step: float
    by_kind: tuple[tuple[str, float], ...]


def _exposure(
    tree: Unit,
    shape: StepShape,
    forward_compute: float,
    done: Sequence[CollectiveRecord],
    grid: RankGrid,
) -> _Exposure:
    """The FSDP collectives of ``tree`` simulated in the runtime's order beside its compute
    (``forward_compute``: seconds of one microbatch's forward), the critical-path kinds of
    ``done`` added whole."""
    m = shape.passes
    fsdp2 = shape.runtime == "torch_fsdp2"
    program = functools.partial(
        microbatch_program,
        tree,
        Runtime(shape.runtime),
        prefetch_forward=shape.prefetch,
        prefetch_backward=shape.prefetch,
        hsdp_bucket_bytes=_hsdp_bucket_bytes(tree, grid),
    )
    # Every microbatch but the last skips the replicas' all-reduce (torch FSDP2: none does).
    regular = simulate(program(all_reduce=fsdp2))
    replicated = any(u.replicate for u in tree.preorder())
    last_mb = simulate(program(all_reduce=True)) if replicated and not fsdp2 else regular

    def per_mb(kind: str, phase: str | None = None) -> float:
        return sum(r.total_time for r in done if r.kind == kind and phase in (None, r.phase)) / m

    critical = ("tp", "ep", "cp", "pp")
    fwd_exposed = regular.mark(FORWARD_END) - forward_compute
    fwd_exposed += sum(per_mb(k, "forward") for k in critical)
    mb_exposed = regular.makespan - regular.compute + sum(per_mb(k) for k in critical)
    muon_time = sum(r.total_time for r in done if r.kind == "muon")
    exposed = (
        *((k, (m - 1) * regular.exposed_of(k) + last_mb.exposed_of(k)) for k in _FSDP),
        *((k, m * per_mb(k)) for k in critical),
        ("muon", muon_time),
    )
    return _Exposure(
        forward=forward_compute + fwd_exposed,
        microbatch=mb_exposed,
        swap=regular.exposed_of(SWAP_KIND),
        step=last_mb.makespan - regular.makespan,
        by_kind=exposed,
    )


def _hsdp_bucket_bytes(tree: Unit, grid: RankGrid) -> int:
    """Where hp-fsdp closes a replicate-axis bucket for ``tree``'s chunks: its cost model's cap
    for the bytes the replicated units put on the ``dp_replicate`` tier."""
    replicas = grid.size("dp_replicate")
    if replicas == 1:
        return 1
    tier = grid.tier("dp_replicate")
    total = sum(u.chunk_bytes for u in tree.preorder() if u.replicate)
    return bucket_cap_bytes(total, replicas, tier.latency, tier.bandwidth)


def _rank_groups(
    model: PricedModel,
    shape: StepShape,
    p: JobDims,
    tp_coordinate: int,
    stage: int,
) -> tuple[GroupSpec, ...]:
    """The FSDP groups of pipeline stage ``stage`` at a rank's tensor-parallel coordinate,
    sharded over ``dp_shard x cp`` (Megatron DDP: whole), as the trainer's JobPlan has them."""
    return fsdp_groups(
        model,
        1 if shape.runtime == "megatron_ddp" else p.dp_shard * p.cp,
        p.tp,
        tp_coordinate=tp_coordinate,
        param_bytes=shape.precision.param,
        pp=p.pp,
        stage=stage,
        ep=p.ep,
        ep_tp=p.ep_tp,
    )


def _stage(
    model: PricedModel,
    grid: RankGrid,
    shape: StepShape,
    device: Device,
    stage: int,
    rank: int,
    microbatch_size: int,
    muon_exact: bool | None,
) -> StageResult:
    """Pipeline stage ``stage`` seen from ``rank``: its FSDP groups, compute, collectives
    (data-parallel, model-parallel, Muon's), their exposure under the runtime's order, its
    memory and host transfers."""
    p = grid.parallel
    coord = grid.coordinate(rank)
    layers = stage_layers(model, p.pp, stage)
    first, last = stage == 0, stage == p.pp - 1
    groups = _rank_groups(model, shape, p, coord["tp"], stage)
    tokens = microbatch_size * shape.seq_len // p.cp
    blocks = sorted({g.block for g in groups if g.block is not None})
    compute = _stage_compute(model, shape, device, p, blocks, tokens, last=last)
    fsdp = _fsdp_costs(groups, grid, shape, device)
    records = [
        *fsdp.records,
        *_model_parallel_records(model, grid, shape, blocks, tokens, first=first, last=last),
    ]
    muon = _stage_muon(model, groups, p, shape, stage, rank, muon_exact)
    if muon.calls:
        records.append(_muon_record(grid, muon))
    tree = _unit_tree(fsdp.units, groups, blocks, compute)
    done = tuple(r for r in records if r is not None)
    exposure = _exposure(tree, shape, compute.forward_total, done, grid)
    memory = memory_breakdown(
        model.shape,
        groups,
        shape,
        shard_coordinates=(coord["fsdp"], coord["expert_shard"]),
        parallel=p,
        microbatch_tokens=tokens,
        in_flight=in_flight(shape.pp_schedule, p.pp, shape.microbatches, stage),
        head=last,
    )
    return StageResult(
        stage=stage,
        rank=rank,
        layers=layers,
        groups=groups,
        memory=memory,
        records=done,
        muon=muon,
        microbatch_compute=compute.microbatch,
        microbatch_exposed=exposure.microbatch,
        exposed_by_kind=exposure.by_kind,
        microbatch_forward=exposure.forward,
        offload_time=_offload_time(groups, shape, memory, device),
        step_exposed=exposure.step,
        microbatch_swap_exposed=exposure.swap,
        fsdp_units=tree,
        fsdp_overhead=fsdp.overhead,
    )


def _unit_tree(
    units: Mapping[str, Unit],
    groups: Sequence[GroupSpec],
    blocks: Sequence[int],
    compute: _StageCompute,
) -> Unit:
    """The stage's ``fully_shard`` states as :class:`Unit` s with their forward compute: the
    root (the embedding's compute taken as zero, the head's last) around the blocks, an MoE
    layer's expert group inside its block (the block's attention before it), each block with
    the seconds its swapped activations take to copy one way. Groups are found by the block
    they belong to (``GroupSpec.block``), whatever the model names its modules."""
    forward, attention = compute.forward, compute.attention
    dense = {g.block: g.name for g in groups if g.block is not None and not g.is_experts}
    expert = {g.block: g.name for g in groups if g.is_experts}
    children = []
    for b in blocks:
        name = dense.get(b, f"block {b}")
        block = units.get(name, Unit(name, (0.0,)))
        experts = units.get(expert[b]) if b in expert else None
        if experts is None:
            block = replace(block, forward=(forward[b],))
        else:
            experts = replace(experts, forward=(forward[b] - attention[b],))
            block = replace(block, forward=(attention[b], 0.0), children=(experts,))
        children.append(replace(block, recompute=compute.recompute[b], swap=compute.swap[b]))
    root = units.get("root", Unit("root", (0.0,)))
    return replace(root, forward=(0.0,) * len(children) + (compute.head,), children=tuple(children))


def _offload_time(
    groups: tuple[GroupSpec, ...], shape: StepShape, memory: MemoryBreakdown, device: Device
) -> float:
    """Seconds of host transfers per step, taken as exposed: ``optimizer`` moves the state in
    and out once per step; ``params`` and ``both`` copy each group's parameter chunk in before
    each of its all-gathers and its reduced gradient chunk out after each reduce-scatter (the
    optimizer then steps in host memory, its time not modeled)."""
    if shape.offload == "optimizer":
        return 2 * memory.host / device.host_bandwidth
    if shape.offload == "none":
        return 0.0
    prec = shape.precision
    moved = sum(
        g.flat.chunk_numel * ((1 if g.is_root else 2) * prec.param + prec.reduce) for g in groups
    )
    return shape.passes * moved / device.host_bandwidth


def _muon_record(grid: RankGrid, muon: MuonTraffic) -> CollectiveRecord:
    """Muon's all-to-alls over the stage's ranks: one message latency per peer over the
    slowest tier of the stage, the bytes that stay in the ``dp_shard x tp`` block at its tier,
    the rest at the slowest tier."""
    stage_ranks = grid.size("dp_replicate") * grid.size("dp_shard") * grid.size("tp")
    top = grid.topology.tier_of_group(range(stage_ranks))
    inner = grid.topology.tier_of_group(range(grid.size("dp_shard") * grid.size("tp")))
    calls = muon.calls
    per_call = (
        muon.peers / calls * top.latency
        + muon.fast_bytes / calls / inner.bandwidth
        + (muon.sent_bytes - muon.fast_bytes) / calls / top.bandwidth
    )
    return CollectiveRecord(
        kind="muon",
        collective=Collective.ALL_TO_ALL,
        phase="step",
        axis="world",
        group_size=stage_ranks,
        tier=top.name,
        nbytes=muon.nbytes // calls,
        sent_bytes=muon.sent_bytes // calls,
        calls=calls,
        time=per_call,
    )


def _summaries(stage: StageResult) -> tuple[KindSummary, ...]:
    exposed = dict(stage.exposed_by_kind)
    out = []
    for kind in KINDS:
        rs = [r for r in stage.records if r.kind == kind]
        tiers: dict[str, tuple[int, float]] = {}
        for r in rs:
            sent, secs = tiers.get(r.tier, (0, 0.0))
            tiers[r.tier] = (sent + r.total_sent, secs + r.total_time)
        out.append(
            KindSummary(
                kind=kind,
                calls=sum(r.calls for r in rs),
                nbytes=sum(r.total_nbytes for r in rs),
                sent_bytes=sum(r.total_sent for r in rs),
                time=sum(r.total_time for r in rs),
                exposed=exposed.get(kind, 0.0),
                by_tier=tuple((t, s, sec) for t, (s, sec) in sorted(tiers.items())),
            )
        )
    return tuple(out)


def dry_run(
    model: PricedModel,
    parallel: JobDims,
    topology: Topology,
    shape: StepShape,
    *,
    device: Device | None = None,
    rank: int = 0,
    muon_exact: bool | None = None,
    model_name: str = "custom",
    all_stages: bool = True,
) -> DryRun:
    """Predict memory, communication and step time of ``model`` under ``parallel`` on
    ``topology`` (see the module doc for the schedule model).

    ``rank`` picks the data-parallel and tensor-parallel coordinate the per-rank figures are
    for (each stage is evaluated at that coordinate). ``device`` defaults to the topology's
    (:func:`hp_planner.price.devices.device_for`). With ``all_stages=False`` (the search) only
    the first, second and last pipeline stages and those holding the most blocks are evaluated
    (the ends hold the embedding and head, the first the most microbatches in flight), so with
    uniform blocks they include the largest and slowest.

    Postconditions: ``memory`` is the largest stage's; ``kinds`` and ``time`` are those of
    the stage with the longest microbatch time; every collective kind of
    :data:`~hp_planner.price.comm.KINDS` appears in ``kinds`` (zero when unused).

    Raises:
        PricingError: the degrees do not multiply to the topology's world size, the trainer
            refuses the configuration (``hp_train.parallel.parallelize.check_model_fits``: ``tp``
            does
            not split the model, ``pp`` exceeds the blocks), or the batch does not split.
    """
    grid = RankGrid.build(parallel, topology)
    check_fits(model, parallel)
    if shape.runtime == "hp":
        model.check_accepts(parallel, shape)
    microbatch_size = shape.microbatch_size(parallel.dp)
    dev = device or device_for(topology)
    coord = grid.coordinate(rank)
    stage_size = parallel.world_size // parallel.pp
    inner = rank - coord["pp"] * stage_size
    stages = tuple(
        _stage(model, grid, shape, dev, s, s * stage_size + inner, microbatch_size, muon_exact)
        for s in _evaluated_stages(model, parallel, all_stages)
    )
    slowest = max(stages, key=lambda s: s.microbatch_time)
    biggest = max(stages, key=lambda s: s.memory.total)
    time = _step_time(stages, slowest, shape, parallel.pp, dev)
    notes = _notes(model, parallel, shape, dev, {s.muon.source for s in stages})
    return DryRun(
        model_name=model_name,
        model=model,
        parameters=parameter_count(model),
        parallel=parallel,
        topology=topology.name,
        device=dev,
        shape=shape,
        microbatch_size=microbatch_size,
        stages=stages,
        memory=biggest.memory,
        kinds=_summaries(slowest),
        time=time,
        notes=tuple(notes),
    )


def _evaluated_stages(model: PricedModel, parallel: JobDims, all_stages: bool) -> Sequence[int]:
    """Every pipeline stage, or (``all_stages=False``) the first, second and last and those
    holding the most blocks (:func:`dry_run`)."""
    if all_stages:
        return range(parallel.pp)
    sizes = [stage_layers(model, parallel.pp, s) for s in range(parallel.pp)]
    most = max(stop - start for start, stop in sizes)
    largest = {s for s, (start, stop) in enumerate(sizes) if stop - start == most}
    return sorted({0, min(1, parallel.pp - 1), parallel.pp - 1} | largest)


def _step_time(
    stages: tuple[StageResult, ...],
    slowest: StageResult,
    shape: StepShape,
    pp: int,
    device: Device,
) -> StepTime:
    """The step time: compute, exposed communication and FSDP's figures of ``slowest`` (the
    stage with the longest microbatch), the pipeline bubble with every stage at its
    microbatch times, and the optimizer's and host transfers' time of the stage of
    ``stages`` that takes longest for each."""
    m = shape.passes
    fsdp_comm = sum(r.total_time for r in slowest.records if r.kind in _FSDP)
    fsdp_comm += slowest.fsdp_overhead
    exposed = dict(slowest.exposed_by_kind)
    bubble = 0.0
    if pp > 1:
        forward = slowest.microbatch_forward
        timing = pipeline_timing(
            shape.pp_schedule,
            pp,
            shape.microbatches,
            forward,
            slowest.microbatch_time - forward,
            0.0,
        )
        bubble = shape.pipeline_steps * timing.bubble  # one fill and drain per schedule
    return StepTime(
        compute=m * slowest.microbatch_compute,
        exposed_comm=m * (slowest.microbatch_exposed - slowest.microbatch_swap_exposed)
        + slowest.step_exposed,
        bubble=bubble,
        optimizer=max(exposed_of(s, "muon") + s.muon.ns_flops / device.flops for s in stages),
        fsdp_comm=fsdp_comm,
        fsdp_exposed=sum(exposed[k] for k in _FSDP),
        offload=max(s.offload_time for s in stages) + m * slowest.microbatch_swap_exposed,
    )


def _notes(
    model: PricedModel,
    parallel: JobDims,
    shape: StepShape,
    device: Device,
    sources: set[str],
) -> list[str]:
    """Caveats of a prediction (what it assumes that the figures depend on)."""
    notes: list[str] = []
    if parallel.pp > 1:
        notes.append(
            f"pp > 1: the bubble is hp-mpmd's simulation of the trainer's {shape.pp_schedule} "
            "plan, every stage at the slowest stage's microbatch time; stages cut as the "
            "trainer cuts them"
        )
    if model.shape.moe is not None and parallel.tp > 1 and not parallel.ep_tp:
        notes.append(
            "MoE feed-forwards (router, experts, shared experts) stay whole on every "
            "tensor-parallel rank, as the trainer keeps them without --ep-tp: their compute "
            "is not divided by tp"
        )
    if parallel.ep > 1:
        notes.append(
            f"expert all-to-alls at a stated imbalance of {shape.expert_imbalance:g} (rows "
            "received over rows sent on this rank); they are on the critical path"
        )
    if parallel.cp > 1:
        notes.append(
            f"context parallelism ({parallel.cp_variant}): its exchanges are synchronous in the "
            "runtime (on the critical path)"
        )
    if shape.fp8 != "none" and device.fp8_peak_flops is None:
        notes.append(f"{device.name} has no FP8 matmul: FP8 linears are timed at bf16 speed")
    if shape.offload != "none":
        notes.append("offload transfers are taken as exposed; the host optimizer step is not timed")
    if shape.swap:
        notes.append(
            f"activation swap: each block's copy to host memory starts at its forward end and "
            f"its copy back at its backward start (and the next block's), at the host link's "
            f"{device.host_bandwidth / 1e9:.0f} GB/s each way; the waits count as offload time"
        )
    if shape.optimizer == "muon" and parallel.ep > 1:
        notes.append(
            "Muon with expert parallelism: the experts' exchange is estimated from each "
            "rank's local stacks as if they were dense matrices of the stage (approximate)"
        )
    if shape.optimizer == "muon":
        if "analytic" in sources:
            notes.append(
                "Muon bytes computed analytically from the layouts (balanced owners); "
                "hp_muon's real plan is used for small cases"
            )
        elif "plan" in sources:
            notes.append("Muon bytes from hp_muon's real plan (plan_muon_step, rank_program)")
    return notes


def exposed_of(stage: StageResult, kind: str) -> float:
    """Exposed seconds of ``kind`` on ``stage`` per step."""
    return dict(stage.exposed_by_kind).get(kind, 0.0)


def stage_groups(model: PricedModel, parallel: JobDims, stage: int) -> tuple[GroupSpec, ...]:
    """The FSDP groups of pipeline stage ``stage`` (tensor-parallel coordinate 0, fp32)."""
    return fsdp_groups(model, parallel.dp_shard, parallel.tp, pp=parallel.pp, stage=stage)
