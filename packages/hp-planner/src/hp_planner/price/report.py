"""Text reports of dry runs and searches (printing is kept apart from planning): memory by
part, communication by collective kind and tier with each kind's exposed share of the step,
the step time and throughput."""

from __future__ import annotations

from hp_planner.price.memory import GIB
from hp_planner.price.run import DryRun
from hp_planner.price.search import SearchResult

__all__ = ["format_dry_run", "format_search"]


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def _config(run: DryRun) -> str:
    p, s = run.parallel, run.shape
    text = f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp}"
    if p.ep > 1:
        text += f" ep={p.ep}" + (" ep_tp" if p.ep_tp else "")
    if p.cp > 1:
        text += f" cp={p.cp} ({p.cp_variant})"
    text += f" microbatches={s.microbatches}"
    if s.pipeline_steps > 1:
        text += f" pipeline_steps={s.pipeline_steps}"
    text += f" ac={s.ac}"
    extras = [
        "swap" if s.swap else "",
        f"offload={s.offload}" if s.offload != "none" else "",
        f"fp8={s.fp8}" if s.fp8 != "none" else "",
        "fp8_all_gather" if s.fp8_all_gather else "",
        f"pp_schedule={s.pp_schedule}" if p.pp > 1 else "",
        f"runtime={s.runtime}" if s.runtime != "hp" else "",
    ]
    return " ".join([text, *(e for e in extras if e)])


def format_dry_run(run: DryRun, *, layers: bool = False) -> str:
    """A multi-line report: configuration, memory, communication by kind and tier, step time."""
    m, t = run.memory, run.time
    lines = [
        f"model {run.model_name}: {run.parameters:,} parameters; topology {run.topology}; "
        f"device {run.device.name} ({run.device.peak_flops / 1e12:.0f} TFLOP/s x "
        f"{run.device.efficiency:.2f})",
        f"  {_config(run)}; {run.microbatch_size} sequence(s) of {run.shape.seq_len} tokens "
        f"per microbatch per data-parallel rank; optimizer {run.shape.optimizer}",
        "memory per rank (largest stage):",
        f"  parameters   {_gib(m.parameters)}",
        f"  gradients    {_gib(m.gradients)}",
        f"  optimizer    {_gib(m.optimizer)}  (Muon momentum {_gib(m.muon_state).strip()})",
        f"  activations  {_gib(m.activations)}",
    ]
    if layers:
        lines += [f"    {name:<12} {_gib(b)} per microbatch" for name, b in m.activations_by_layer]
    lines += [f"  {name:<28} {_gib(b)}" for name, b in m.buffers]
    lines.append(f"  total        {_gib(m.total)}")
    if m.host:
        lines.append(f"  (in host memory: {_gib(m.host).strip()})")
    if m.swapped:
        lines.append(
            f"  (swapped activations in host memory: {_gib(m.swapped).strip()}; "
            f"{_gib(m.fetched).strip()} fetched back at once in backward)"
        )
    lines.append("communication per step per rank (slowest stage):")
    lines.append(
        f"  {'kind':<20} {'calls':>7} {'sent':>12} {'time':>9} {'exposed':>9} {'share':>6}  tiers"
    )
    for k in run.kinds:
        if not k.calls:
            continue
        tiers = ", ".join(
            f"{name} {sent / GIB:.2f} GiB {secs:.3f}s" for name, sent, secs in k.by_tier
        )
        share = 100 * k.exposed / t.total if t.total else 0.0
        lines.append(
            f"  {k.kind:<20} {k.calls:>7} {k.sent_bytes / GIB:>8.2f} GiB {k.time:>8.3f}s "
            f"{k.exposed:>8.3f}s {share:>5.1f}%  {tiers}"
        )
    lines += [
        "step time:",
        f"  compute {t.compute:.3f}s + exposed comm {t.exposed_comm:.3f}s + bubble "
        f"{t.bubble:.3f}s + optimizer {t.optimizer:.3f}s"
        + (f" + offload {t.offload:.3f}s" if t.offload else "")
        + f" = {t.total:.3f}s; "
        f"{run.shape.global_batch * run.shape.seq_len / t.total / 1e3:,.0f}k tokens/s",
        f"  FSDP communication: {t.fsdp_comm:.3f}s = {100 * t.fsdp_fraction:.1f}% of the step "
        f"({t.fsdp_exposed:.3f}s = {100 * t.fsdp_exposed_fraction:.1f}% exposed)",
    ]
    lines += [f"note: {n}" for n in run.notes]
    return "\n".join(lines)


def format_search(result: SearchResult, top: int = 5) -> str:
    """The ``top`` fastest fitting configurations with memory and communication breakdowns."""
    lines = [
        f"searched {result.evaluated} configurations: {len(result.fitting)} fit in "
        f"{result.memory_limit / GIB:.1f} GiB per rank, {result.rejected} do not"
    ]
    if not result.fitting:
        if result.smallest_rejected:
            lines.append(
                f"none fits: the smallest needs {result.smallest_rejected / GIB:.1f} GiB per rank"
            )
        return "\n".join(lines)
    notes: list[str] = []
    for i, run in enumerate(result.fitting[:top], 1):
        m, t = run.memory, run.time
        lines.append(f"#{i} {_config(run)}: step {t.total:.3f}s, memory {m.total / GIB:.1f} GiB")
        lines.append(
            f"    memory: params {m.parameters / GIB:.1f} + grads {m.gradients / GIB:.1f} + "
            f"optimizer {m.optimizer / GIB:.1f} + activations {m.activations / GIB:.1f} + "
            f"buffers {m.buffer_total / GIB:.1f} GiB"
        )
        parts = ", ".join(
            f"{k.kind} {k.time:.3f}s ({k.exposed:.3f}s exposed)" for k in run.kinds if k.calls
        )
        lines.append(
            f"    time: compute {t.compute:.3f}s, bubble {t.bubble:.3f}s, optimizer "
            f"{t.optimizer:.3f}s; comm {parts}"
        )
        notes += [n for n in run.notes if n not in notes and not n.startswith("Muon bytes")]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
