"""The dry run's text report (pure formatting, apart from the prediction).

:func:`format_prediction` writes what :func:`hp_planner.price.format_dry_run` writes, with
three differences for a reader: byte counts in the unit that suits each (B, KiB, MiB, GiB,
TiB: a tiny model's 40 KiB of parameters is not ``0.00 GiB``; :func:`human_bytes`), a line
saying whether the predicted peak fits the device's memory and, where it does not, what to
change (:func:`fit_line`), and lines no wider than the terminal or 100 columns
(:func:`wrap_lines`; the notes used to run to 400 characters).
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Iterable

from hp_planner.price import DryRun

__all__ = [
    "REPORT_WIDTH",
    "fit_line",
    "format_prediction",
    "human_bytes",
    "report_width",
    "wrap_lines",
]

#: The report's width when the output is not a terminal (and its most on one).
REPORT_WIDTH = 100

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit (B, KiB, MiB, GiB, TiB, PiB) in which it is at
    least 1, with two decimals (none for bytes): ``human_bytes(40960) == "40.00 KiB"``,
    ``human_bytes(0) == "0 B"``."""
    size = float(n)
    unit = 0
    while abs(size) >= 1024 and unit < len(_UNITS) - 1:
        size /= 1024
        unit += 1
    return f"{size:.0f} B" if unit == 0 else f"{size:.2f} {_UNITS[unit]}"


def human_seconds(t: float) -> str:
    """``t`` seconds in s, ms or us, whichever keeps it at least 1 (us below that), with
    three decimals: ``human_seconds(0.0123) == "12.300ms"``, ``human_seconds(0) == "0.000us"``."""
    if abs(t) >= 1:
        return f"{t:.3f}s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.3f}ms"
    return f"{t * 1e6:.3f}us"


def report_width() -> int:
    """The terminal's width when stdout is one (at most :data:`REPORT_WIDTH`, at least 40),
    else :data:`REPORT_WIDTH`."""
    if not sys.stdout.isatty():
        return REPORT_WIDTH
    columns = shutil.get_terminal_size((REPORT_WIDTH, 24)).columns
    return max(40, min(columns, REPORT_WIDTH))


def wrap_lines(lines: Iterable[str], width: int) -> list[str]:
    """Every line of ``lines`` no wider than ``width``: a longer one is broken at spaces, its
    continuation lines indented 4 more than its own indentation (a word longer than the width
    stays whole)."""
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(
            line.strip(),
            width,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return out


def fit_line(run: DryRun) -> str:
    """Whether the predicted peak of the stage that needs the most fits the device's memory:
    ``fits: ...`` with the headroom, or ``does not fit: ...`` with what to change (the
    largest part of the peak first)."""
    m, device = run.memory, run.device
    peak, limit = m.total, device.memory_bytes
    where = f"predicted peak {human_bytes(peak)} per rank vs {human_bytes(limit)} of {device.name}"
    if peak <= limit:
        return f"fits: {where} ({100 * peak / limit:.2g}%)"
    state = m.state + m.buffer_total
    if m.activations > state:
        change = (
            "activations are the largest part: checkpoint them (--ac full or selective, --swap), "
            "or run fewer sequences per microbatch (--grad-accum, or --microbatches with --pp)"
        )
    else:
        change = (
            "parameters, gradients, optimizer state and FSDP buffers are the largest part: shard "
            "them over more ranks (--dp-shard, --tp, --pp, --ep) or --offload them"
        )
    return (
        f"does not fit: {where} ({peak / limit:.1f}x; {human_bytes(peak - limit)} over); "
        f"{change}; --search finds the fastest layout that fits"
    )


def _config(run: DryRun) -> str:
    p, s = run.parallel, run.shape
    parts = [f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} pp={p.pp}"]
    if p.ep > 1:
        parts.append(f"ep={p.ep}" + (" ep_tp" if p.ep_tp else ""))
    if p.cp > 1:
        parts.append(f"cp={p.cp} ({p.cp_variant})")
    accumulation = f"microbatches={s.microbatches}" if p.pp > 1 else f"grad_accum={s.microbatches}"
    parts.append(accumulation)
    if s.pipeline_steps > 1:
        parts.append(f"grad_accum={s.pipeline_steps}")
    parts.append(f"ac={s.ac}")
    extras = [
        "swap" if s.swap else "",
        f"offload={s.offload}" if s.offload != "none" else "",
        f"fp8={s.fp8}" if s.fp8 != "none" else "",
        "fp8_all_gather" if s.fp8_all_gather else "",
        f"pp_schedule={s.pp_schedule}" if p.pp > 1 else "",
    ]
    return " ".join([*parts, *(e for e in extras if e)])


def _memory(run: DryRun, layers: bool) -> list[str]:
    m = run.memory
    lines = [
        "memory per rank (largest stage):",
        f"  {'parameters':<28} {human_bytes(m.parameters):>12}",
        f"  {'gradients':<28} {human_bytes(m.gradients):>12}",
        f"  {'optimizer':<28} {human_bytes(m.optimizer):>12}  "
        f"(Muon momentum {human_bytes(m.muon_state)})",
        f"  {'activations':<28} {human_bytes(m.activations):>12}",
    ]
    if layers:
        lines += [
            f"    {name:<26} {human_bytes(b):>12} per microbatch"
            for name, b in m.activations_by_layer
        ]
    lines += [f"  {name:<28} {human_bytes(b):>12}" for name, b in m.buffers]
    lines.append(f"  {'total (peak)':<28} {human_bytes(m.total):>12}")
    if m.host:
        lines.append(f"  (in host memory: {human_bytes(m.host)})")
    if m.swapped:
        lines.append(
            f"  (swapped activations in host memory: {human_bytes(m.swapped)}; "
            f"{human_bytes(m.fetched)} fetched back at once in backward)"
        )
    return lines


def _communication(run: DryRun) -> list[str]:
    total = run.time.total
    lines = [
        "communication per step per rank (slowest stage):",
        f"  {'kind':<20} {'calls':>7} {'sent':>12} {'time':>10} {'exposed':>10} "
        f"{'share':>6}  tiers",
    ]
    for k in run.kinds:
        if not k.calls:
            continue
        tiers = ", ".join(
            f"{name} {human_bytes(sent)} {human_seconds(secs)}" for name, sent, secs in k.by_tier
        )
        share = 100 * k.exposed / total if total else 0.0
        lines.append(
            f"  {k.kind:<20} {k.calls:>7} {human_bytes(k.sent_bytes):>12} "
            f"{human_seconds(k.time):>10} {human_seconds(k.exposed):>10} {share:>5.1f}%  {tiers}"
        )
    return lines


def format_prediction(run: DryRun, *, layers: bool = False, width: int = REPORT_WIDTH) -> str:
    """The report of ``run`` (module doc): configuration, memory by part (by layer with
    ``layers``), whether it fits, communication by kind and tier, step time, notes; every line
    at most ``width`` characters but for a single word longer than that."""
    t, device = run.time, run.device
    sec = human_seconds
    tokens_per_s = run.shape.global_batch * run.shape.seq_len / t.total if t.total else 0.0
    lines = [
        f"model {run.model_name}: {run.parameters:,} parameters; topology {run.topology}; "
        f"device {device.name} ({device.peak_flops / 1e12:.0f} TFLOP/s x "
        f"{device.efficiency:.2f}, {human_bytes(device.memory_bytes)})",
        f"  {_config(run)}; {run.microbatch_size} sequence(s) of {run.shape.seq_len} tokens "
        f"per microbatch per data-parallel rank; optimizer {run.shape.optimizer}",
        *_memory(run, layers),
        fit_line(run),
        *_communication(run),
        "step time:",
        f"  compute {sec(t.compute)} + exposed comm {sec(t.exposed_comm)} + bubble "
        f"{sec(t.bubble)} + optimizer {sec(t.optimizer)}"
        + (f" + offload {sec(t.offload)}" if t.offload else "")
        + f" = {sec(t.total)}; {tokens_per_s:,.0f} tokens/s",
        f"  FSDP communication: {sec(t.fsdp_comm)} = {100 * t.fsdp_fraction:.1f}% of the step "
        f"({sec(t.fsdp_exposed)} = {100 * t.fsdp_exposed_fraction:.1f}% exposed)",
        *(f"note: {n}" for n in run.notes),
    ]
    return "\n".join(wrap_lines(lines, width))
