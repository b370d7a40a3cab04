"""``--reproduce-paper``: the 505B MoE on the 768-die supernode, predicted beside the paper.

The paper reports, for this model on one Ascend supernode (768 dies), 421k tokens/s with
FSDP communication at 2.9% of the step, and a step time 29.7% below PyTorch FSDP2's and
25.5% below Megatron DDP's (:data:`PAPER`). :func:`reproduce_paper` runs the search
(:func:`~hp_planner.price.search.search`) over :data:`REPRODUCTION_SPACE` three times, once
per data-parallel runtime (:data:`~hp_planner.price.workload.RUNTIMES`: hp-fsdp as hp-train
runs it, a modeled PyTorch FSDP2 and a modeled Megatron DDP), each keeping what fits the die's
memory, and compares the best of each with the paper's figures. Every predicted number comes
from the model; where one differs from the paper's by more than :data:`GAP` (relative), the
comparison carries the assumption that explains it, with the model's own figures (the MFU
that would close the gap, the seconds each runtime loses where). The presets' sources are
printed with the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hp_planner.price.devices import device_for, topology_preset, topology_source
from hp_planner.price.memory import GIB
from hp_planner.price.model import PricedModel
from hp_planner.price.run import DryRun
from hp_planner.price.search import SearchResult, SearchSpace, search
from hp_planner.price.workload import StepShape

__all__ = [
    "GAP",
    "PAPER",
    "REPRODUCTION_SPACE",
    "Comparison",
    "PaperFigures",
    "Reproduction",
    "format_reproduction",
    "reproduce_paper",
]

GAP = 0.20
"""A prediction further than this (relative) from the paper's figure gets an explanation."""


@dataclass(frozen=True)
class PaperFigures:
    """What the paper reports for the 505B MoE on one 768-die supernode.

    Attributes:
        tokens_per_second: training throughput of the whole supernode.
        fsdp_share: FSDP communication as a share of the step.
        below_fsdp2: how much shorter the step is than PyTorch FSDP2's (a fraction).
        below_megatron: how much shorter the step is than Megatron DDP's.
    """

    tokens_per_second: float = 421e3
    fsdp_share: float = 0.029
    below_fsdp2: float = 0.297
    below_megatron: float = 0.255


PAPER = PaperFigures()
"""The paper's figures, as the hp-train issue quotes them."""

REPRODUCTION_SPACE = SearchSpace(
    dp_replicate=(1, 2),
    tp=(1, 2, 4, 8),
    ep=(1, 8, 16, 32, 64, 128, 256),
    cp=(1,),
    pp=(1, 2, 4, 8),
    ep_tp=(False,),
    microbatches=(1, 2, 4, 8),
    ac=("selective", "full"),
)
"""What the reproduction searches (kept small enough to run in well under a minute): the
layouts a 505B MoE on one supernode is trained with (expert parallelism up to one expert
per die, tensor parallelism inside a card pair and beyond, short pipelines, two replicas at
most), microbatches and the checkpointing policies that can fit 64 GiB."""


@dataclass(frozen=True)
class Comparison:
    """One of the paper's figures beside the prediction.

    Attributes:
        figure: what is compared.
        paper: the paper's value.
        predicted: the model's.
        explanation: the assumption that explains a gap beyond :data:`GAP` (None within).
    """

    figure: str
    paper: float
    predicted: float
    explanation: str | None

    @property
    def deviation(self) -> float:
        """``predicted / paper - 1``."""
        return self.predicted / self.paper - 1 if self.paper else 0.0


@dataclass(frozen=True)
class Reproduction:
    """The reproduction's results.

    Attributes:
        model_name: the model preset.
        topology: the topology preset.
        memory_limit: bytes per rank the configurations must fit.
        hp: the search under hp-fsdp (fastest first).
        fsdp2: the search under modeled PyTorch FSDP2.
        megatron: the search under modeled Megatron DDP.
        comparisons: the paper's figures beside the predictions.
        sources: where the hardware figures come from.
        seconds: wall-clock seconds the three searches took on this machine.
    """

    model_name: str
    topology: str
    memory_limit: int
    hp: SearchResult
    fsdp2: SearchResult
    megatron: SearchResult
    comparisons: tuple[Comparison, ...]
    sources: tuple[str, ...]
    seconds: float = 0.0


def tokens_per_second(run: DryRun) -> float:
    """Tokens the whole world trains per second under ``run``."""
    return run.shape.global_batch * run.shape.seq_len / run.time.total


def _best(result: SearchResult) -> DryRun | None:
    return result.fitting[0] if result.fitting else None


def _explain_throughput(best: DryRun, paper: float) -> str:
    t = best.time
    needed = best.device.efficiency * tokens_per_second(best) / paper
    # The MFU at which the predicted step would give the paper's throughput, with the same
    # communication and bubble (solving compute' = step' - rest).
    step = best.shape.global_batch * best.shape.seq_len / paper
    rest = t.total - t.compute
    mfu = best.device.efficiency * t.compute / (step - rest) if step > rest else float("inf")
    return (
        f"compute is {t.compute:.2f}s of the {t.total:.2f}s step at the assumed MFU "
        f"{best.device.efficiency:.2f} (Device.efficiency, not a published figure); the "
        f"paper's throughput needs an MFU of {mfu:.2f} with the same communication "
        f"({needed:.2f} if communication scaled with compute)"
    )


def _explain_share(best: DryRun) -> str:
    t = best.time
    parts = ", ".join(
        f"{kind} {best.kind(kind).exposed:.2f}s of {best.kind(kind).time:.2f}s"
        for kind in ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce")
        if best.kind(kind).time
    )
    return (
        f"the model runs the runtime's order of collectives on one stream per tier "
        f"({t.fsdp_comm:.2f}s of FSDP collectives, {t.fsdp_exposed:.2f}s exposed: {parts}): "
        f"it assumes the FSDP stream gets the Unified Bus's full per-die bandwidth beside the "
        f"expert all-to-alls (no contention) and no per-collective launch cost; both would "
        f"raise the exposed share toward the paper's"
    )


def _explain_baseline(best: DryRun, other: DryRun, name: str, paper_gain: float) -> str:
    mine, theirs = best.time, other.time
    parts = {
        "exposed FSDP/DDP communication": theirs.fsdp_exposed - mine.fsdp_exposed,
        "compute (its layout)": theirs.compute - mine.compute,
        "other exposed communication": (theirs.exposed_comm - theirs.fsdp_exposed)
        - (mine.exposed_comm - mine.fsdp_exposed),
        "pipeline bubble": theirs.bubble - mine.bubble,
        "optimizer": theirs.optimizer - mine.optimizer,
    }
    listed = ", ".join(f"{k} {v:+.2f}s" for k, v in parts.items() if abs(v) >= 0.005)
    target = mine.total / (1 - paper_gain)
    return (
        f"modeled {name} ({_layout(other)}) differs from hp-fsdp by {listed or 'nothing'}; the "
        f"paper's gain would need a {name} step of {target:.2f}s: the model prices only bytes "
        f"and latency of each collective and the copies it names, not the per-parameter "
        f"collectives, launch overheads and memory fragmentation of a real run"
    )


def _layout(run: DryRun) -> str:
    p, s = run.parallel, run.shape
    parts = [f"dp_replicate={p.dp_replicate}", f"dp_shard={p.dp_shard}"]
    parts += [f"{k}={getattr(p, k)}" for k in ("tp", "ep", "cp", "pp") if getattr(p, k) > 1]
    if p.cp > 1:
        parts.append(f"cp_variant={p.cp_variant}")
    if p.ep_tp:
        parts.append("ep_tp")
    parts += [f"microbatches={s.microbatches}", f"ac={s.ac}"]
    if s.swap:
        parts.append("swap")
    return " ".join(parts)


def _comparisons(
    hp: DryRun, fsdp2: DryRun | None, megatron: DryRun | None, limit: int
) -> list[Comparison]:
    out = []
    tps = tokens_per_second(hp)
    out.append(
        Comparison(
            "tokens/s",
            PAPER.tokens_per_second,
            tps,
            None
            if abs(tps / PAPER.tokens_per_second - 1) <= GAP
            else _explain_throughput(hp, PAPER.tokens_per_second),
        )
    )
    share = hp.time.fsdp_exposed_fraction
    out.append(
        Comparison(
            "FSDP communication share (exposed)",
            PAPER.fsdp_share,
            share,
            None if abs(share / PAPER.fsdp_share - 1) <= GAP else _explain_share(hp),
        )
    )
    for name, other, gain in (
        ("PyTorch FSDP2", fsdp2, PAPER.below_fsdp2),
        ("Megatron DDP", megatron, PAPER.below_megatron),
    ):
        if other is None:
            continue
        predicted = 1 - hp.time.total / other.time.total
        close = abs(predicted - gain) <= GAP * gain
        why = None if close else _explain_baseline(hp, other, name, gain)
        if other.memory.total > limit:
            why = (
                f"no {name} layout of the space fits {limit / GIB:.0f} GiB (plain DDP replicates "
                f"parameters, gradients and optimizer state over the data-parallel ranks); "
                f"compared with the one closest to fitting ({other.memory.total / GIB:.1f} "
                f"GiB): the paper's run must have sharded more (a distributed optimizer, not "
                f"modeled); " + (why or "")
            )
        out.append(Comparison(f"step time below {name}", gain, predicted, why))
    return out


def reproduce_paper(
    model: PricedModel,
    shape: StepShape,
    *,
    model_name: str = "moe_505b",
    topology: str = "ascend_supernode",
    space: SearchSpace = REPRODUCTION_SPACE,
) -> Reproduction:
    """Search the three runtimes for ``model`` (the paper's, :data:`PAPER`: a trainer's
    preset of it) stepping ``shape`` on ``topology`` over ``space`` and compare (module doc).

    Raises:
        PricingError: nothing fits under hp-fsdp (the search's message), or a bad preset.
    """
    topo = topology_preset(topology)
    device = device_for(topo)
    limit = device.memory_bytes
    start = time.perf_counter()
    results = {
        runtime: search(
            model,
            topo,
            replace(shape, runtime=runtime),
            limit,
            device=device,
            space=space,
            model_name=model_name,
        )
        for runtime in ("hp", "torch_fsdp2", "megatron_ddp")
    }
    seconds = time.perf_counter() - start
    hp = _best(results["hp"])
    # Where nothing fits, the comparison takes the layout closest to fitting (and says so).
    baselines = {
        runtime: _best(results[runtime]) or results[runtime].closest
        for runtime in ("torch_fsdp2", "megatron_ddp")
    }
    comparisons: tuple[Comparison, ...] = ()
    if hp is not None:
        comparisons = tuple(
            _comparisons(hp, baselines["torch_fsdp2"], baselines["megatron_ddp"], limit)
        )
    sources = (
        f"device {device.name}: {device.source}",
        f"topology {topo.name}: {topology_source(topology)}",
    )
    return Reproduction(
        model_name=model_name,
        topology=topo.name,
        memory_limit=limit,
        hp=results["hp"],
        fsdp2=results["torch_fsdp2"],
        megatron=results["megatron_ddp"],
        comparisons=comparisons,
        sources=sources,
        seconds=seconds,
    )


def _row(rank: int, run: DryRun) -> str:
    t = run.time
    return (
        f"  #{rank} {_layout(run)}: {run.memory.total / GIB:.1f} GiB/rank, step {t.total:.2f}s, "
        f"{tokens_per_second(run) / 1e3:.0f}k tokens/s, FSDP comm {100 * t.fsdp_fraction:.1f}% "
        f"({100 * t.fsdp_exposed_fraction:.1f}% exposed)"
    )


def _exposed(run: DryRun) -> str:
    total = run.time.total
    parts = [f"{k.kind} {100 * k.exposed / total:.1f}%" for k in run.kinds if k.calls and total > 0]
    return "    exposed share by kind: " + ", ".join(parts)


def _value(v: float, percent: bool) -> str:
    return f"{100 * v:.1f}%" if percent else f"{v / 1e3:.0f}k"


def format_reproduction(r: Reproduction, top: int = 3) -> str:
    """The report: best configurations per runtime, then the paper beside the prediction."""
    lines = [
        f"paper reproduction: {r.model_name} on {r.topology}, memory limit "
        f"{r.memory_limit / GIB:.0f} GiB per rank (searched in {r.seconds:.0f} s)",
    ]
    for title, result in (
        ("hp-fsdp (hp-train)", r.hp),
        (
            "PyTorch FSDP2 (modeled: copy-in/out, per-group all-reduce, no cross-tier pipeline)",
            r.fsdp2,
        ),
        ("Megatron DDP (modeled: replicated parameters, one all-reduce per block)", r.megatron),
    ):
        lines.append(
            f"{title}: {result.evaluated} evaluated, {len(result.fitting)} fit"
            + (f", {result.refused} refused by hp-train" if result.refused else "")
        )
        if not result.fitting:
            lines.append(
                f"  none fits; the smallest needs {result.smallest_rejected / GIB:.1f} GiB"
            )
        for i, run in enumerate(result.fitting[:top], 1):
            lines.append(_row(i, run))
        if result.fitting:
            lines.append(_exposed(result.fitting[0]))
    lines.append("paper vs predicted:")
    for c in r.comparisons:
        percent = "share" in c.figure or "below" in c.figure
        lines.append(
            f"  {c.figure:<36} paper {_value(c.paper, percent):>7}  predicted "
            f"{_value(c.predicted, percent):>7}  ({100 * c.deviation:+.0f}%)"
        )
        if c.explanation:
            lines.append(f"    why: {c.explanation}")
    lines += [f"source: {s}" for s in r.sources]
    return "\n".join(lines)
