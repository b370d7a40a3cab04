"""The dry run: memory, communication and step time of one configuration, without processes.

Schedule model (per microbatch, on each pipeline stage; stated so its numbers can be checked):

* **Forward.** The root's all-gather is exposed. With prefetch, block ``i``'s all-gather
  overlaps the forward compute of the unit before it (the root's embedding, whose compute is
  taken as zero, then block ``i - 1``); only what exceeds that compute is exposed. Without
  prefetch (hp_fsdp on CPU) every all-gather is exposed.
* **Backward.** Units run head first (the root's parameters are still unsharded), then the
  blocks in reverse. While unit ``k`` computes its backward (plus its recomputed forward), the
  FSDP stream carries the prefetched re-gather of unit ``k + 1`` and the reduce-scatter of unit
  ``k - 1``, one after the other; what exceeds the compute is exposed. The reduce-scatters of
  the last block and of the root come after the last compute and are exposed.
* **HSDP all-reduce** (replicate axis, the slow tier): pipelined behind the whole backward;
  exposed is the larger of the last groups' (block 0 and root) all-reduce and whatever the
  total exceeds the backward compute by.
* **Tensor parallel** all-reduces and all-gathers, pipeline sends and Muon's exchange are on
  the critical path (fully exposed). Newton-Schulz runs on the owners after the exchange. The
  activation collectives are those of the trainer's resolved plan
  (:func:`~hp_train.dryrun.shapes.tp_collectives`: the boundaries of each block, the embedding
  and the head; an MoE block's feed-forward is whole, so only its attention's), each of one
  microbatch's activation (``tokens x dim``), the head's of its logits.
* **Pipeline** (1F1B): a step takes ``(microbatches + pp - 1)`` times the slowest stage's
  microbatch time; the bubble fraction is ``(pp - 1) / (microbatches + pp - 1)``. Stages keep
  the blocks the trainer gives them (:func:`hp_train.pipeline.stage_boundaries`).

Compute time is FLOPs (:mod:`hp_train.dryrun.workload`) over the device's achieved
throughput. Elementwise optimizer work and kernel launch overheads are not modeled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hp_layout import Collective, Topology
from hp_train.config import ModelConfig, ParallelConfig
from hp_train.dryrun.comm import KINDS, CollectiveRecord, RankGrid
from hp_train.dryrun.memory import MemoryBreakdown, memory_breakdown
from hp_train.dryrun.muon_traffic import MuonTraffic, muon_traffic
from hp_train.dryrun.presets import Device, device_for
from hp_train.dryrun.shapes import (
    GroupSpec,
    check_fits,
    fsdp_groups,
    parameter_count,
    stage_layers,
    tp_collectives,
)
from hp_train.dryrun.workload import StepShape, block_forward_flops, head_forward_flops

__all__ = ["DryRun", "KindSummary", "StageResult", "StepTime", "dry_run"]

_FSDP = ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce")


@dataclass(frozen=True)
class KindSummary:
    """One collective kind over a step on one rank.

    Attributes:
        kind: one of :data:`hp_train.dryrun.comm.KINDS`.
        calls: collectives issued.
        nbytes: bytes, unsharded-side convention (:mod:`hp_train.dryrun.comm`).
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
        exposed_comm: communication not hidden, over all microbatches (FSDP, HSDP, TP, PP).
        bubble: pipeline idle time, ``(pp - 1)`` microbatch times.
        optimizer: Muon's exchange and Newton-Schulz.
        fsdp_comm: time of all FSDP and HSDP collectives (hidden or not).
        fsdp_exposed: their exposed part.
    """

    compute: float
    exposed_comm: float
    bubble: float
    optimizer: float
    fsdp_comm: float
    fsdp_exposed: float

    @property
    def total(self) -> float:
        """Seconds per step."""
        return self.compute + self.exposed_comm + self.bubble + self.optimizer

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
    model: ModelConfig
    parameters: int
    parallel: ParallelConfig
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


def _exposed_forward(units: Sequence[tuple[float, float]], prefetch: bool) -> float:
    """``units``: ``(all-gather, forward compute)`` in forward order."""
    if not prefetch:
        return sum(ag for ag, _ in units)
    exposed = units[0][0] if units else 0.0
    for k in range(1, len(units)):
        exposed += max(0.0, units[k][0] - units[k - 1][1])
    return exposed


def _exposed_backward(
    units: Sequence[tuple[float, float, float]], prefetch: bool
) -> tuple[float, float]:
    """``units``: ``(all-gather, reduce-scatter, backward compute)`` in backward order.

    Returns the exposed all-gather and reduce-scatter seconds; the first unit's all-gather
    has no compute before it, the last unit's reduce-scatter none after it.
    """
    ag_exposed = rs_exposed = 0.0
    n = len(units)
    if not prefetch:
        ag_exposed = sum(u[0] for u in units)
    elif units:
        ag_exposed = units[0][0]
    for k in range(n):
        ag = units[k + 1][0] if prefetch and k + 1 < n else 0.0
        rs = units[k - 1][1] if k >= 1 else 0.0
        over = max(0.0, ag + rs - units[k][2])
        if over and ag + rs:
            ag_exposed += over * ag / (ag + rs)
            rs_exposed += over * rs / (ag + rs)
    if n:
        rs_exposed += units[-1][1]
    return ag_exposed, rs_exposed


def _time_of(records: Sequence[CollectiveRecord], kind: str) -> float:
    return sum(r.time for r in records if r.kind == kind)


def _stage(
    model: ModelConfig,
    grid: RankGrid,
    shape: StepShape,
    device: Device,
    stage: int,
    rank: int,
    microbatch_size: int,
    muon_exact: bool | None,
) -> StageResult:
    p = grid.parallel
    pp, m = p.pp, shape.microbatches
    coord = grid.coordinate(rank)
    layers = stage_layers(model, pp, stage)
    first, last = stage == 0, stage == pp - 1
    groups = fsdp_groups(
        model,
        p.dp_shard,
        p.tp,
        tp_coordinate=coord["tp"],
        param_bytes=shape.precision.param,
        layers=layers,
        embedding=first,
        head=last,
    )
    prec = shape.precision
    tokens = microbatch_size * shape.seq_len
    act = tokens * model.dim * prec.compute
    flops = device.flops
    blocks = [g for g in groups if not g.is_root]
    root = next((g for g in groups if g.is_root), None)
    fwd = {
        g.name: block_forward_flops(model, int(g.name.split(".")[1]), p.tp, shape.seq_len)
        * tokens
        / flops
        for g in blocks
    }
    head_fwd = head_forward_flops(model, p.tp) * tokens / flops if last else 0.0
    recompute = sum(fwd.values()) if shape.recompute else 0.0
    mb_compute = 3 * (sum(fwd.values()) + head_fwd) + recompute

    records: list[CollectiveRecord | None] = []
    ag: dict[str, float] = {}
    rs: dict[str, float] = {}
    ar: dict[str, float] = {}
    for g in groups:
        padded, chunk = g.flat.padded_numel, g.flat.chunk_numel
        gather = grid.record(
            "fsdp_all_gather",
            Collective.ALL_GATHER,
            "forward",
            "dp_shard",
            padded * prec.compute,
            m,
        )
        regather = (
            None
            if g.is_root
            else grid.record(
                "fsdp_all_gather",
                Collective.ALL_GATHER,
                "backward",
                "dp_shard",
                padded * prec.compute,
                m,
            )
        )
        scatter = grid.record(
            "fsdp_reduce_scatter",
            Collective.REDUCE_SCATTER,
            "backward",
            "dp_shard",
            padded * prec.reduce,
            m,
        )
        reduce = grid.record(
            "hsdp_all_reduce",
            Collective.ALL_REDUCE,
            "backward",
            "dp_replicate",
            chunk * prec.reduce,
            m,
        )
        tail = grid.record(
            "tp",
            Collective.ALL_REDUCE,
            "backward",
            "tp",
            (padded - g.extra_start) * prec.compute,
            m,
        )
        records += [gather, regather, scatter, reduce, tail]
        ag[g.name] = gather.time if gather else 0.0
        rs[g.name] = scatter.time if scatter else 0.0
        ar[g.name] = reduce.time if reduce else 0.0
    # Per microbatch, by phase and collective: the blocks' activation collectives (again in
    # the recomputed forward), the embedding's, and the head's of the logits.
    block_calls: dict[tuple[str, str], int] = {}
    for g in blocks:
        forward, backward = tp_collectives(model, g.name)
        for phase, kinds in (("forward", forward), ("backward", backward)):
            for kind in kinds:
                block_calls[phase, kind] = block_calls.get((phase, kind), 0) + 1
    phases = ("forward", "backward", "recompute") if shape.recompute else ("forward", "backward")
    tp_records = [
        grid.record("tp", Collective(kind), phase, "tp", act, n * m)
        for phase in phases
        for (of, kind), n in block_calls.items()
        if of == (phase if phase != "recompute" else "forward")
    ]
    units = ([("tok_embeddings", act)] if first else []) + (
        [("output", tokens * model.vocab_size * prec.compute)] if last else []
    )
    for unit, nbytes in units:
        forward, backward = tp_collectives(model, unit)
        for phase, kinds in (("forward", forward), ("backward", backward)):
            tp_records += [grid.record("tp", Collective(k), phase, "tp", nbytes, m) for k in kinds]
    if pp > 1:
        if not last:
            tp_records.append(grid.record("pp", Collective.SEND_RECV, "forward", "pp", act, m))
        if not first:
            tp_records.append(grid.record("pp", Collective.SEND_RECV, "backward", "pp", act, m))
    records += tp_records

    stage_parallel = ParallelConfig(p.dp_replicate, p.dp_shard, p.tp, 1)
    stage_rank = rank - stage * stage_parallel.world_size
    if shape.optimizer == "muon":
        muon = muon_traffic(
            groups,
            stage_parallel,
            rank=stage_rank,
            bucket_mb=shape.muon_bucket_mb,
            exact=muon_exact,
        )
    else:
        muon = MuonTraffic("none", 0, 0, 0, 0, 0, 0, 0.0)
    if muon.calls:
        records.append(_muon_record(grid, muon))

    units_f = ([(ag[root.name], 0.0)] if root else []) + [(ag[g.name], fwd[g.name]) for g in blocks]
    ag_fwd = _exposed_forward(units_f, shape.prefetch)
    factor = 3.0 if shape.recompute else 2.0
    # The root's reduce-scatter goes last (the embedding's gradient is the last one), so its
    # unit carries none and it is added as exposed after the last unit.
    units_b = ([(0.0, 0.0, 2 * head_fwd)] if root else []) + [
        (ag[g.name], rs[g.name], factor * fwd[g.name]) for g in reversed(blocks)
    ]
    ag_bwd, rs_bwd = _exposed_backward(units_b, shape.prefetch)
    if root is not None:
        rs_bwd += rs[root.name]
    backward_compute = sum(u[2] for u in units_b)
    ar_total = sum(ar.values())
    ar_last = (ar[root.name] if root else 0.0) + (ar[blocks[0].name] if blocks else 0.0)
    ar_exposed = max(ar_last, ar_total - backward_compute) if ar_total else 0.0
    tp_time = sum(r.total_time for r in records if r is not None and r.kind == "tp") / m
    pp_time = sum(r.total_time for r in records if r is not None and r.kind == "pp") / m
    mb_exposed = ag_fwd + ag_bwd + rs_bwd + ar_exposed + tp_time + pp_time
    muon_time = sum(r.total_time for r in records if r is not None and r.kind == "muon")
    exposed = (
        ("fsdp_all_gather", m * (ag_fwd + ag_bwd)),
        ("fsdp_reduce_scatter", m * rs_bwd),
        ("hsdp_all_reduce", m * ar_exposed),
        ("tp", m * tp_time),
        ("pp", m * pp_time),
        ("muon", muon_time),
    )
    in_flight = min(pp - stage, m) if pp > 1 else 1
    memory = memory_breakdown(
        model,
        groups,
        shape,
        shard_coordinate=coord["dp_shard"],
        tp=p.tp,
        microbatch_tokens=tokens,
        in_flight=in_flight,
        head=last,
    )
    return StageResult(
        stage=stage,
        rank=rank,
        layers=layers,
        groups=groups,
        memory=memory,
        records=tuple(r for r in records if r is not None),
        muon=muon,
        microbatch_compute=mb_compute,
        microbatch_exposed=mb_exposed,
        exposed_by_kind=exposed,
    )


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
    model: ModelConfig,
    parallel: ParallelConfig,
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
    (:func:`hp_train.dryrun.presets.device_for`). With ``all_stages=False`` (the search) only
    the first, second and last pipeline stages and those holding the most blocks are evaluated
    (the ends hold the embedding and head, the first the most microbatches in flight), so with
    uniform blocks they include the largest and slowest.

    Postconditions: ``memory`` is the largest stage's; ``kinds`` and ``time`` are those of
    the stage with the longest microbatch time; every collective kind of
    :data:`~hp_train.dryrun.comm.KINDS` appears in ``kinds`` (zero when unused).

    Raises:
        DryRunError: the degrees do not multiply to the topology's world size, the trainer
            refuses the configuration (``hp_train.parallelize.check_model_fits``: ``tp`` does
            not split the model, ``pp`` exceeds the blocks), or the batch does not split.
    """
    grid = RankGrid.build(parallel, topology)
    check_fits(model, parallel)
    microbatch_size = shape.microbatch_size(parallel.dp)
    dev = device or device_for(topology)
    coord = grid.coordinate(rank)
    stage_size = parallel.world_size // parallel.pp
    inner = rank - coord["pp"] * stage_size
    if all_stages:
        chosen: Sequence[int] = range(parallel.pp)
    else:
        sizes = [stage_layers(model, parallel.pp, s) for s in range(parallel.pp)]
        most = max(stop - start for start, stop in sizes)
        largest = {s for s, (start, stop) in enumerate(sizes) if stop - start == most}
        chosen = sorted({0, min(1, parallel.pp - 1), parallel.pp - 1} | largest)
    stages = tuple(
        _stage(model, grid, shape, dev, s, s * stage_size + inner, microbatch_size, muon_exact)
        for s in chosen
    )
    slowest = max(stages, key=lambda s: s.microbatch_time)
    biggest = max(stages, key=lambda s: s.memory.total)
    m, pp = shape.microbatches, parallel.pp
    fsdp_comm = sum(r.total_time for r in slowest.records if r.kind in _FSDP)
    exposed = dict(slowest.exposed_by_kind)
    time = StepTime(
        compute=m * slowest.microbatch_compute,
        exposed_comm=m * slowest.microbatch_exposed,
        bubble=(pp - 1) * slowest.microbatch_time,
        optimizer=max(exposed_of(s, "muon") + s.muon.ns_flops / dev.flops for s in stages),
        fsdp_comm=fsdp_comm,
        fsdp_exposed=sum(exposed[k] for k in _FSDP),
    )
    notes: list[str] = []
    if pp > 1:
        notes.append(
            "pp > 1 is modeled as 1F1B (bubble (pp-1)/(microbatches+pp-1)), the stages cut as "
            "the trainer cuts them"
        )
    if model.moe is not None and parallel.tp > 1:
        notes.append(
            "MoE feed-forwards (router, experts, shared experts) stay whole on every "
            "tensor-parallel rank, as the trainer's TP plan keeps them: their compute and "
            "memory are not divided by tp"
        )
    sources = {s.muon.source for s in stages}
    if shape.optimizer == "muon":
        if "analytic" in sources:
            notes.append(
                "Muon bytes computed analytically from the layouts (balanced owners); "
                "hp_muon's real plan is used for small cases"
            )
        elif "plan" in sources:
            notes.append("Muon bytes from hp_muon's real plan (plan_muon_step, rank_program)")
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


def exposed_of(stage: StageResult, kind: str) -> float:
    """Exposed seconds of ``kind`` on ``stage`` per step."""
    return dict(stage.exposed_by_kind).get(kind, 0.0)


def stage_groups(model: ModelConfig, parallel: ParallelConfig, stage: int) -> tuple[GroupSpec, ...]:
    """The FSDP groups of pipeline stage ``stage`` (tensor-parallel coordinate 0, fp32)."""
    layers = stage_layers(model, parallel.pp, stage)
    return fsdp_groups(
        model,
        parallel.dp_shard,
        parallel.tp,
        layers=layers,
        embedding=stage == 0,
        head=stage == parallel.pp - 1,
    )
