"""Plan the communication of one Llama-7B-shaped block on Ascend supernodes, without torch.

Run ``python -m hp_layout.demo [--supernodes N]``. The mesh is ``(replicate, shard, tp)``:
tensor parallel over 8 dies, FSDP over the rest of a supernode, HSDP replicas across
supernodes. For each weight the demo packs the block's FSDP flat buffer, derives each
weight's RaggedShard layout, and plans three redistributions: the FSDP all-gather before
compute, the gradient reduce-scatter after it, and the cross-supernode gradient reduction.
It prints the plans' steps, bytes per tier, alpha-beta time estimates, and planning time.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from hp_layout.flat_buffer import plan_flat_buffer
from hp_layout.layout import Layout
from hp_layout.mesh import Mesh
from hp_layout.placement import Partial, Placement, Replicate, Shard
from hp_layout.redistribute import RedistributePlan, plan_redistribute
from hp_layout.topology import Topology

HIDDEN, FFN, TP = 4096, 11008, 8
WEIGHTS: dict[str, tuple[tuple[int, int], Placement]] = {
    "attn.q_proj": ((HIDDEN, HIDDEN), Shard(0)),
    "attn.k_proj": ((HIDDEN, HIDDEN), Shard(0)),
    "attn.v_proj": ((HIDDEN, HIDDEN), Shard(0)),
    "attn.o_proj": ((HIDDEN, HIDDEN), Shard(1)),
    "mlp.gate_proj": ((FFN, HIDDEN), Shard(0)),
    "mlp.up_proj": ((FFN, HIDDEN), Shard(0)),
    "mlp.down_proj": ((HIDDEN, FFN), Shard(1)),
}
BF16 = 2


@dataclass(frozen=True)
class _Row:
    weight: str
    step: str
    collectives: str
    bytes_by_tier: dict[str, int]
    estimated_ms: float


def _describe(name: str, what: str, plan: RedistributePlan, topo: Topology) -> _Row:
    steps = ", ".join(f"{s.kind.value}[{s.axis}]" for s in plan.steps) or "none"
    return _Row(
        name,
        what,
        steps,
        plan.bytes_by_tier(topo, BF16),
        round(plan.estimated_time(topo, BF16) * 1e3, 3),
    )


def main(argv: list[str] | None = None) -> int:
    """Print the plans and a JSON summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--supernodes", type=int, default=2, help="number of 768-die supernodes")
    args = parser.parse_args(argv)
    topo = Topology.ascend_supernode(args.supernodes)
    mesh = Mesh((args.supernodes, 768 // TP, TP), ("replicate", "shard", "tp"))
    tiers = {n: t.name for n, t in topo.axis_tiers(mesh).items()}
    print(f"topology {topo.name}; mesh {mesh!r}; axis tiers {tiers}")

    tp_layouts = {
        name: Layout(shape, mesh, [Replicate(), Replicate(), tp])
        for name, (shape, tp) in WEIGHTS.items()
    }
    local_shapes = [tp_layouts[n].local_shape(0) for n in WEIGHTS]
    packed = plan_flat_buffer(local_shapes, shards=mesh.axis_size("shard"), alignment=64)
    print(
        f"flat buffer: {len(WEIGHTS)} weights, {packed.used_numel} elements per TP rank, "
        f"chunk {packed.chunk_numel} per FSDP rank, "
        f"padding {packed.padded_numel - packed.used_numel}"
    )

    rows = []
    started = time.perf_counter()
    for index, name in enumerate(WEIGHTS):
        tp = tp_layouts[name]
        sharded = packed.layout(index, mesh, "shard", base=tp)
        grads = tp.with_placements([Partial(), Partial(), tp.placements[2]])
        reduced = sharded.with_placements([Partial(), *sharded.placements[1:]], sharded.shard_order)
        rows.append(_describe(name, "all-gather", plan_redistribute(sharded, tp, topo), topo))
        rows.append(
            _describe(name, "reduce-scatter", plan_redistribute(grads, reduced, topo), topo)
        )
        if args.supernodes > 1:
            rows.append(
                _describe(name, "hsdp-reduce", plan_redistribute(reduced, sharded, topo), topo)
            )
    planning_ms = (time.perf_counter() - started) * 1e3

    header = f"{'weight':<14} {'step':<15} {'collectives':<52} {'est. ms':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.weight:<14} {row.step:<15} {row.collectives:<52} {row.estimated_ms:>8}")
    slow = topo.tiers[-1].name
    slow_bytes = sum(row.bytes_by_tier[slow] for row in rows)
    total_bytes = sum(sum(row.bytes_by_tier.values()) for row in rows)
    print(f"planned {len(rows)} redistributions in {planning_ms:.1f} ms")
    print(
        json.dumps(
            {
                "demo": "hp_layout",
                "topology": topo.name,
                "plans": len(rows),
                "planning_ms": round(planning_ms, 2),
                "bytes_total": total_bytes,
                f"bytes_{slow}": slow_bytes,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
