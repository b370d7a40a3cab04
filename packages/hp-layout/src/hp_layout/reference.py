"""Reference executor: runs redistribution plans on numpy arrays for N virtual ranks.

This module is the only part of hp_layout that needs numpy (install the ``reference`` extra).
It exists to prove plans right: :func:`scatter` cuts a global array into the shards a layout
gives each rank, :func:`execute` runs a plan's steps as the named collectives would (each
step sees only the local data of its group's ranks), and :func:`assemble` puts shards back
together, checking that replicas agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hp_layout.chunking import chunk_bounds
from hp_layout.errors import LayoutError
from hp_layout.layout import Layout
from hp_layout.placement import Partial, RaggedShard, ReduceOp, Shard
from hp_layout.redistribute import RedistributePlan, Step, StepKind
from hp_layout.region import Region
from hp_layout.transfer import TransferPlan, local_index_runs

__all__ = ["ExecutionResult", "assemble", "execute", "execute_transfer", "scatter"]

Array = NDArray[Any]
Shards = dict[int, Array]


def _take(data: Array, region: Region, within: Region) -> Array:
    """The part of ``data`` (holding ``within``'s box) that ``region`` names."""
    if within.flat is not None:
        raise LayoutError("cannot slice out of flat (RaggedShard) local data")
    index = tuple(
        slice(a - base, b - base) for (a, b), (base, _) in zip(region.box, within.box, strict=True)
    )
    part = data[index]
    if region.flat is None:
        return part
    return part.reshape(-1)[region.flat[0] : region.flat[1]]


def _reduce(op: ReduceOp, parts: list[Array]) -> Array:
    stacked = np.stack(parts)
    reduced: Array
    if op is ReduceOp.SUM:
        reduced = stacked.sum(axis=0)
    elif op is ReduceOp.AVG:
        reduced = stacked.mean(axis=0)
    elif op is ReduceOp.MAX:
        reduced = stacked.max(axis=0)
    else:
        reduced = stacked.min(axis=0)
    return reduced


def _split(op: ReduceOp, value: Array, parts: int, rng: np.random.Generator | None) -> list[Array]:
    """``parts`` arrays whose reduction by ``op`` is exactly ``value`` (for integer data)."""
    if rng is None:
        if op is ReduceOp.SUM:
            return [value] + [np.zeros_like(value) for _ in range(parts - 1)]
        return [value.copy() for _ in range(parts)]
    noise = [rng.integers(0, 10, size=value.shape).astype(value.dtype) for _ in range(parts)]
    if op is ReduceOp.SUM:
        return [*noise[:-1], value - sum(noise[:-1], np.zeros_like(value))]
    if op is ReduceOp.AVG:
        zero_mean = [*noise[:-1], -sum(noise[:-1], np.zeros_like(value))]
        return [value + n for n in zero_mean]
    keeper = int(rng.integers(parts))
    sign = -1 if op is ReduceOp.MAX else 1
    return [value if i == keeper else value + sign * noise[i] for i in range(parts)]


def scatter(array: Array, layout: Layout, rng: np.random.Generator | None = None) -> Shards:
    """The local data each rank holds when ``array`` is distributed as ``layout``.

    Partial axes split each value into parts whose reduction is the value: with ``rng``,
    random integer parts (use integer arrays for exact checks); without, coordinate 0 holds
    the value and the others zeros (sum) or copies (avg, max, min).
    """
    if tuple(array.shape) != layout.global_shape:
        raise LayoutError(
            f"array shape {array.shape} differs from the layout's {layout.global_shape}"
        )
    whole = Region(tuple((0, n) for n in layout.global_shape))
    shards = {r: _take(array, layout.local_region(r), whole).copy() for r in layout.mesh.ranks}
    mesh = layout.mesh
    replicated = [mesh.axis_index(n) for n in layout.replicated_axes]
    for name, placement in zip(mesh.axis_names, layout.placements, strict=True):
        if not isinstance(placement, Partial):
            continue
        # Replicas (groups that differ only along Replicate axes) must get identical parts.
        splits: dict[tuple[int, ...], list[Array]] = {}
        for group in mesh.groups(name):
            coordinate = mesh.coordinate(group[0])
            key = tuple(c for i, c in enumerate(coordinate) if i not in replicated)
            if key not in splits:
                splits[key] = _split(placement.op, shards[group[0]], len(group), rng)
            shards.update(zip(group, (p.copy() for p in splits[key]), strict=True))
    return shards


def assemble(shards: Mapping[int, Array], layout: Layout) -> Array:
    """The global array that ``shards`` hold under ``layout``.

    Partial values are reduced; every element must be given identically by every rank that
    holds it (replicas, and the members of partial groups after reduction).

    Raises:
        LayoutError: when a shard is missing, has the wrong shape, or replicas disagree.
    """
    mesh = layout.mesh
    missing = [r for r in mesh.ranks if r not in shards]
    if missing:
        raise LayoutError(f"no shard given for ranks {missing}")
    for r in mesh.ranks:
        if tuple(shards[r].shape) != layout.local_shape(r):
            raise LayoutError(
                f"rank {r} holds shape {shards[r].shape}, layout wants {layout.local_shape(r)}"
            )
    ops = [p.op for p in layout.placements if isinstance(p, Partial)]
    dtype = np.result_type(*(s.dtype for s in shards.values()))
    if ops and ops[0] is ReduceOp.AVG:
        dtype = np.result_type(dtype, np.float64)
    out = np.zeros(layout.global_shape, dtype=dtype)
    seen = np.zeros(layout.global_shape, dtype=bool)
    for r in mesh.ranks:
        group = layout.partial_group(r)
        value = _reduce(ops[0], [shards[g] for g in group]) if ops else shards[r]
        region = layout.local_region(r)
        index = tuple(slice(a, b) for a, b in region.box)
        block = out[index]
        mask = seen[index]
        new_block: Array
        new_mask: Array
        if region.flat is None:
            new_block, new_mask = value, np.ones(block.shape, dtype=bool)
        else:
            new_block = block.reshape(-1).copy()
            new_mask = np.zeros(block.size, dtype=bool)
            new_block[region.flat[0] : region.flat[1]] = value
            new_mask[region.flat[0] : region.flat[1]] = True
            new_block = new_block.reshape(block.shape)
            new_mask = new_mask.reshape(block.shape)
        clash = mask & new_mask & (block != new_block)
        if clash.any():
            raise LayoutError(f"rank {r} disagrees with another holder of the same elements")
        out[index] = np.where(new_mask, new_block, block)
        seen[index] = mask | new_mask
    if out.size and not seen.all():
        raise LayoutError("the shards do not cover the whole tensor")
    return out


@dataclass(frozen=True)
class ExecutionResult:
    """What :func:`execute` returns.

    Attributes:
        shards: each rank's local data after the plan.
        received: per step, elements received summed over all ranks, counted from the data
            actually exchanged (all-reduce counted as reduce-scatter plus all-gather).
    """

    shards: Shards
    received: tuple[int, ...]


def _run_step(step: Step, shards: Shards) -> tuple[Shards, int]:
    out: Shards = {}
    received = 0
    before, after = step.before, step.after
    kind = step.kind
    for group in step.groups:
        local = [shards[r] for r in group]
        p = len(group)
        if kind is StepKind.LOCAL_SLICE:
            for r, data in zip(group, local, strict=True):
                out[r] = _take(data, after.local_region(r), before.local_region(r)).copy()
        elif kind is StepKind.LOCAL_PARTITION:
            keep_all = step.reduce_op is not ReduceOp.SUM
            for i, (r, data) in enumerate(zip(group, local, strict=True)):
                out[r] = data.copy() if keep_all or i == 0 else np.zeros_like(data)
        elif kind is StepKind.ALL_GATHER:
            if isinstance(step.src_placement, RaggedShard):
                whole = np.concatenate([d.reshape(-1) for d in local])
                whole = whole.reshape(after.local_shape(group[0]))
            else:
                assert isinstance(step.src_placement, Shard)
                whole = np.concatenate(local, axis=step.src_placement.dim)
            for r, data in zip(group, local, strict=True):
                out[r] = whole.copy()
                received += whole.size - data.size
        elif kind in (StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE):
            op = step.reduce_op
            assert op is not None
            reduced = _reduce(op, local)
            if kind is StepKind.ALL_REDUCE:
                # A reduce-scatter then an all-gather: each moves (p - 1) / p of the buffer
                # per rank, 2 * (p - 1) buffers per group in all.
                received += 2 * (p - 1) * reduced.size
            for r in group:
                if kind is StepKind.ALL_REDUCE:
                    out[r] = reduced.copy()
                else:
                    piece = _take(reduced, after.local_region(r), before.local_region(r)).copy()
                    out[r] = piece
                    received += (p - 1) * piece.size
        else:
            src, dst = step.src_placement, step.dst_placement
            assert isinstance(src, Shard)
            assert isinstance(dst, Shard)
            for j, r in enumerate(group):
                pieces = []
                for i, data in enumerate(local):
                    lo, hi = chunk_bounds(data.shape[dst.dim], p, j)
                    piece = np.take(data, np.arange(lo, hi), axis=dst.dim)
                    pieces.append(piece)
                    if i != j:
                        received += piece.size
                out[r] = np.concatenate(pieces, axis=src.dim)
    return out, received


def execute(plan: RedistributePlan, shards: Mapping[int, Array]) -> ExecutionResult:
    """Run ``plan`` on ``shards`` (rank -> local data under ``plan.src``)."""
    current = dict(shards)
    for r in plan.src.mesh.ranks:
        if r not in current:
            raise LayoutError(f"no shard given for rank {r}")
        if tuple(current[r].shape) != plan.src.local_shape(r):
            raise LayoutError(
                f"rank {r} holds shape {current[r].shape}; {plan.src!r} gives it "
                f"{plan.src.local_shape(r)}"
            )
    received = []
    for step in plan.steps:
        current, count = _run_step(step, current)
        received.append(count)
    return ExecutionResult(current, tuple(received))


def _gather_runs(flat: Array, runs: tuple[tuple[int, int], ...]) -> Array:
    if not runs:
        return flat[:0]
    return np.concatenate([flat[start : start + length] for start, length in runs])


def execute_transfer(plan: TransferPlan, shards: Mapping[int, Array]) -> Shards:
    """Run ``plan`` on ``shards`` (source rank -> local data under ``plan.src``).

    Returns each destination rank's local data. Like a point-to-point executor, each phase
    packs, per (sender, receiver), the sender's boxes in :meth:`TransferPlan.sends` order into
    one message, using :func:`local_index_runs` on the sender's send buffer, and unpacks the
    message in :meth:`TransferPlan.receives` order into the receiver's buffer. Every element
    of every receive buffer must be written exactly once.

    Raises:
        LayoutError: when a source shard is missing or misshapen, or a plan leaves an element
            of a receive buffer unwritten or writes it twice.
    """
    current: Shards = {}
    for r in plan.src.mesh.ranks:
        if r not in shards:
            raise LayoutError(f"no shard given for source rank {r}")
        if tuple(shards[r].shape) != plan.src.local_shape(r):
            raise LayoutError(
                f"source rank {r} holds shape {shards[r].shape}; {plan.src!r} gives it "
                f"{plan.src.local_shape(r)}"
            )
        current[r] = np.asarray(shards[r]).reshape(-1)
    dtype = np.result_type(*(a.dtype for a in current.values())) if current else np.float64
    for phase in range(len(plan.phases)):
        messages: dict[tuple[int, int], list[Array]] = {}
        for sender in sorted(current):
            region = plan.send_region(sender, phase)
            for piece in plan.sends(sender, phase):
                runs = local_index_runs(region, piece.box)
                key = (sender, piece.dst_rank)
                messages.setdefault(key, []).append(_gather_runs(current[sender], runs))
        filled: Shards = {}
        for receiver in plan.receivers(phase):
            region = plan.receive_region(receiver, phase)
            out = np.zeros(region.numel, dtype=dtype)
            written = np.zeros(region.numel, dtype=np.int64)
            offsets: dict[int, int] = {}
            for piece in plan.receives(receiver, phase):
                message = np.concatenate(messages[(piece.src_rank, receiver)])
                at = offsets.get(piece.src_rank, 0)
                for start, length in local_index_runs(region, piece.box):
                    out[start : start + length] = message[at : at + length]
                    written[start : start + length] += 1
                    at += length
                offsets[piece.src_rank] = at
            if (written != 1).any():
                raise LayoutError(
                    f"phase {phase} of the {plan.method!r} plan writes rank {receiver}'s "
                    f"elements {sorted(set(written.tolist()))} times, not once each"
                )
            filled[receiver] = out
        current = filled
    return {r: current[r].reshape(plan.dst.local_shape(r)) for r in plan.dst.mesh.ranks}
