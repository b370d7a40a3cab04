"""Benchmark: FSDP training step, hp-fsdp vs torch FSDP2, with DDP as the floor.

The same Llama (``hp_testing.llama.Llama``, same seed; blocks sharded, then the root) trains
with AdamW on gloo ranks of this machine (one thread each), in these layouts:

* ``1-d w2``: world 2, one shard axis (``hp_fsdp.fully_shard`` on a 1-d ``DeviceMesh``;
  ``torch.distributed.fsdp.fully_shard`` on ``init_device_mesh("cpu", (2,))``);
* ``1-d w4``: world 4, one shard axis;
* ``HSDP 2x2``: world 4, mesh ``(replicate, shard) = (2, 2)`` for both;
* ``per_param``: the 1-d layouts again with ``fully_shard(..., param_layout="per_param")``
  (FSDP2's layout: torch DTensor parameters, a copy out of the all-gather and into the
  reduce-scatter), printed under each, with its ratio to torch FSDP2 and to the flat layout;
* ``DDP w2`` / ``DDP w4``: ``torch.nn.parallel.DistributedDataParallel`` over all ranks
  (whole parameters on every rank, one bucketed all-reduce: the reference floor);
* ``floor w2`` / ``floor w4``: every rank trains its own whole copy on its batch with no
  communication at all, the ranks sharing the machine's cores as in the other variants: the
  compute floor of a step (what a data-parallel step costs if communication were free). Its
  first loss must equal the others'; later ones differ (no gradient averaging).
* ``comm w2`` / ``comm w4`` (1-d mesh) and ``comm HSDP``: hp-fsdp's collectives of one step
  alone, no compute: each group's parameter all-gather (the blocks twice, the root once; an
  exchange over a pair of gloo ranks, as hp-fsdp runs it), its gradient reduce-scatter (an
  all-to-all and the rank-order sum, as on gloo) and, for HSDP, one all-reduce of the gradient
  chunks over the replicate axis (the same bytes as hp-fsdp's buckets, in one call), each
  waited for at once. On a
  machine whose cores are all computing (one thread per rank, as many ranks as cores), gloo's
  copies through the loopback compete with compute for the same cores, so ``floor + comm`` is
  what the step costs when nothing overlaps, and the floor is what it costs when everything
  does: where hp-fsdp's step lies between them is how much of its communication it hides.

A step is zero_grad, forward, cross-entropy, backward and ``AdamW.step`` on this rank's batch.
The first losses of the variants of one world must agree (same weights, same batches). After a
warm-up, the variants are timed in interleaved rounds (order rotated per round); reported: the
median over rounds of the mean step time, and ratios hp / torch and x / DDP.

Measured per variant besides time, outside the timed rounds:

* ``peak MiB``: the peak, during one training step, of the bytes the C allocator has handed out
  and not taken back (glibc ``mallinfo2``: ``uordblks + hblkhd``, sampled after every operator
  by a ``TorchDispatchMode`` and after the step), minus the same count just before the variant's
  model was built. It covers parameters, gradients, optimizer states, FSDP buffers (also those
  resized outside the dispatcher), activations and communication scratch memory; it is rank 0's
  (all ranks hold the same sizes). Where ``mallinfo2`` is missing (not glibc), the column shows
  the growth of the process's peak resident set (``ru_maxrss``) over the variant, a coarser
  measure; the JSON line says which was used. The BLAS library's workspace buffers are
  allocated before the first variant (an undistributed warm-up step), so no variant pays them.
  The JSON line also has ``rest`` MiB: in use between steps, after ``zero_grad(set_to_none=True)``
  (parameters, optimizer states, and whatever gradient storage the implementation keeps).
* copy kernels and collectives per step, counted with ``hp_fsdp.counting.CountingMode``.

This machine is noisy: compare the ratios of one run. Prints a table and one JSON line.

hp-fsdp prefetches in both directions by default, CPU included (``hp_fsdp.policy.
default_prefetch``); ``--forward-prefetch-only`` turns backward prefetch off, to measure what
it buys (it costs one more group's unsharded parameters at the peak).

Run: ``nox -s bench -- fsdp_step.py`` (or ``python benchmarks/fsdp_step.py`` with the packages
importable, e.g. ``PYTHONPATH=packages/hp-layout/src:packages/hp-dtensor/src:...``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _machine import machine_info, machine_line
from _ranks import run_local_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=1024, dim=256, n_layers=4, n_heads=8, ffn_dim=704, max_seq_len=64)
LOCAL_BATCH, SEQ = 4, 64
LR = 1e-3
WARMUP = 3
ROUNDS = 9
STEPS = 2  # timed steps per variant per round
LOSS_TOLERANCE = 1e-4  # warm-up losses of the variants of one world (DDP sums differently)


_NO_SYNC = ("local", "comm")  # variants whose losses are not the synchronized training's


@dataclass(frozen=True)
class Variant:
    """One way of training the model."""

    name: str  # row label
    impl: str  # "hp" | "hp_per_param" | "torch" | "ddp" | "local" | "comm"
    mesh: tuple[int, ...]  # data-parallel mesh; () for DDP


WORLDS: dict[int, tuple[Variant, ...]] = {
    2: (
        Variant("1-d w2", "hp", (2,)),
        Variant("1-d w2", "torch", (2,)),
        Variant("1-d w2", "hp_per_param", (2,)),
        Variant("DDP w2", "ddp", ()),
        Variant("floor w2", "local", ()),
        Variant("1-d w2", "comm", (2,)),
    ),
    4: (
        Variant("1-d w4", "hp", (4,)),
        Variant("1-d w4", "torch", (4,)),
        Variant("1-d w4", "hp_per_param", (4,)),
        Variant("HSDP 2x2", "hp", (2, 2)),
        Variant("HSDP 2x2", "torch", (2, 2)),
        Variant("DDP w4", "ddp", ()),
        Variant("floor w4", "local", ()),
        Variant("1-d w4", "comm", (4,)),
        Variant("HSDP 2x2", "comm", (2, 2)),
    ),
}


# ---------------------------------------------------------------------------------------------
# Memory: bytes handed out by the C allocator
# ---------------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_reader() -> Callable[[], int] | None:
    """``() -> bytes in use`` from glibc's ``mallinfo2``, or None where it is missing."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return int(info.uordblks) + int(info.hblkhd)

    return in_use


_HEAP = _heap_reader()
MEMORY_MEASURE = "mallinfo2" if _HEAP is not None else "ru_maxrss"


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _HeapPeak(TorchDispatchMode):
    """Peak of ``mallinfo2`` in-use bytes, sampled after every operator."""

    def __init__(self, read: Callable[[], int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self.read = read
        self.peak = read()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.read())
        return out


def _in_use() -> int:
    gc.collect()
    return _HEAP() if _HEAP is not None else _maxrss_bytes()


def _step_peak(train: Callable[[], float]) -> int:
    """Peak bytes in use during one call of ``train`` (see the module docstring)."""
    if _HEAP is None:
        train()
        return _maxrss_bytes()
    tracker = _HeapPeak(_HEAP)
    with tracker:
        train()
    return max(tracker.peak, _HEAP())


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------


def _mesh_names(mesh: tuple[int, ...]) -> tuple[str, ...]:
    return ("shard",) if len(mesh) == 1 else ("replicate", "shard")


def _hp(mesh_shape: tuple[int, ...], layout: str = "flat") -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh(mesh_shape, _mesh_names(mesh_shape)))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh, param_layout=layout)
    fully_shard(model, mesh=mesh, param_layout=layout)
    if FORWARD_PREFETCH_ONLY:
        model.set_implicit_prefetch(True, False)  # type: ignore[operator]
    return model


def _torch(mesh_shape: tuple[int, ...]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=_mesh_names(mesh_shape))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ddp() -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    return DistributedDataParallel(Llama(CONFIG))


def _build(variant: Variant) -> nn.Module:
    if variant.impl == "hp":
        return _hp(variant.mesh)
    if variant.impl == "hp_per_param":
        return _hp(variant.mesh, "per_param")
    if variant.impl == "torch":
        return _torch(variant.mesh)
    if variant.impl == "local":
        torch.manual_seed(0)
        return Llama(CONFIG)
    return _ddp()


def _communication(mesh_shape: tuple[int, ...]) -> Callable[[], float]:
    """One step of hp-fsdp's collectives for ``mesh_shape``, no compute (``comm`` variants)."""
    from hp_dtensor import DeviceMesh
    from hp_fsdp._collectives import ReduceScatterPrimitive, all_gather, reduce_scatter
    from hp_fsdp._state import fsdp_state
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh(mesh_shape, _mesh_names(mesh_shape)))
    shard, world = mesh.get_group("shard"), mesh_shape[-1]
    replicate = mesh.get_group("replicate") if len(mesh_shape) == 2 else None
    model = _hp(mesh_shape)
    layers: Any = model.layers
    states = [fsdp_state(m) for m in (model, *layers)]
    groups = [(g, state is not states[0]) for state in states if state for g in state.groups]
    full = {id(g): torch.empty(g.flat.padded_numel) for g, _ in groups}
    chunks = {id(g): torch.empty(g.plan.chunk_numel) for g, _ in groups}

    def step() -> float:
        for g, _ in groups:  # forward
            all_gather(full[id(g)], g.sharded_flat, shard, world).wait()
        for g, block in reversed(groups):  # backward: blocks again, then every reduce
            if block:
                all_gather(full[id(g)], g.sharded_flat, shard, world).wait()
            a2a = ReduceScatterPrimitive.ALL_TO_ALL
            reduce_scatter(chunks[id(g)], full[id(g)], shard, world, a2a).wait()
        if replicate is not None:
            dist.all_reduce(torch.cat(list(chunks.values())), group=replicate)
        return 0.0

    return step


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    return ids.chunk(world)[rank], targets.chunk(world)[rank]


def _trainer(model: nn.Module) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, targets = _batch()

    def train() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return train


def _per_step(train: Callable[[], float]) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        train()
    return (time.perf_counter() - start) / STEPS


def _counts(train: Callable[[], float]) -> dict[str, Any]:
    from hp_fsdp.counting import CountingMode

    with CountingMode() as counts:
        train()
    return {
        "copies": counts.copy_count,
        "collectives": {f"{k}/{n}": c for (k, n), c in sorted(counts.collective_counts().items())},
    }


def _warm_up_kernels() -> None:
    """Train an undistributed copy of the model once: the BLAS library keeps workspace buffers
    (several MiB) after its first matrix products of each shape, and the first variant measured
    would be charged for them otherwise."""
    torch.manual_seed(0)
    train = _trainer(Llama(CONFIG))
    for _ in range(2):
        train()


def _bench_world(variants: tuple[Variant, ...]) -> dict[str, Any]:
    _warm_up_kernels()
    trainers: list[Callable[[], float]] = []
    losses: list[list[float]] = []
    peaks: list[int] = []
    rests: list[int] = []
    counts: list[dict[str, Any]] = []
    for variant in variants:
        before = _in_use()
        model = None if variant.impl == "comm" else _build(variant)
        train = _communication(variant.mesh) if model is None else _trainer(model)
        losses.append([train() for _ in range(WARMUP)])
        peaks.append(_step_peak(train) - before)
        if model is not None:
            model.zero_grad(set_to_none=True)
        rests.append(_in_use() - before)
        counts.append(_counts(train))
        trainers.append(train)
    synced = [run for run, v in zip(losses, variants, strict=True) if v.impl not in _NO_SYNC]
    drift = max(
        abs(a - b) for run in synced for other in synced for a, b in zip(run, other, strict=True)
    )
    trained = [run for run, v in zip(losses, variants, strict=True) if v.impl != "comm"]
    drift = max(drift, *(abs(run[0] - losses[0][0]) for run in trained))
    if drift > LOSS_TOLERANCE:
        raise AssertionError(f"warm-up losses of {variants} differ by {drift:.2e}: {losses}")
    times: list[list[float]] = [[] for _ in variants]
    order = list(range(len(variants)))
    for round_index in range(ROUNDS):
        shift = round_index % len(order)
        for index in order[shift:] + order[:shift]:
            times[index].append(_per_step(trainers[index]))
    return {
        "rows": [
            {
                "layout": v.name,
                "impl": v.impl,
                "ms": statistics.median(t) * 1e3,
                "ms_min": min(t) * 1e3,
                "peak_mib": peak / 2**20,
                "rest_mib": rest / 2**20,
                **c,
            }
            for v, t, peak, rest, c in zip(variants, times, peaks, rests, counts, strict=True)
        ],
        "first_loss": losses[0][0],
        "warmup_loss_spread": drift,
    }


def _rank(world: int) -> dict[str, Any]:
    return _bench_world(WORLDS[world])


def _run_world(world: int) -> dict[str, Any]:
    result: dict[str, Any] = run_local_ranks(world, _rank, world)
    return result


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _table(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    header = (
        f"{'layout':<10}{'hp ms':>8}{'torch ms':>10}{'hp/torch':>10}{'hp/DDP':>8}"
        f"{'torch/DDP':>10}{'hp MiB':>8}{'torch MiB':>10}{'hp/torch':>9}"
        f"{'copies hp/torch':>16}  collectives hp | torch"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for world, result in results.items():
        by = {(r["layout"], r["impl"]): r for r in result["rows"]}
        ddp = by[(f"DDP w{world}", "ddp")]
        floor = by[(f"floor w{world}", "local")]
        layouts = [
            r["layout"]
            for r in result["rows"]
            if r["impl"] not in ("ddp", "hp_per_param", "local", "comm")
        ]
        for layout in dict.fromkeys(layouts):
            hp, theirs = by[(layout, "hp")], by[(layout, "torch")]
            row = {
                "layout": layout,
                "world": world,
                "hp_ms": hp["ms"],
                "torch_ms": theirs["ms"],
                "ddp_ms": ddp["ms"],
                "floor_ms": floor["ms"],
                "hp_vs_floor": hp["ms"] / floor["ms"],
                "torch_vs_floor": theirs["ms"] / floor["ms"],
                "ddp_vs_floor": ddp["ms"] / floor["ms"],
                "hp_vs_torch": hp["ms"] / theirs["ms"],
                "hp_vs_ddp": hp["ms"] / ddp["ms"],
                "torch_vs_ddp": theirs["ms"] / ddp["ms"],
                "hp_ms_min": hp["ms_min"],
                "torch_ms_min": theirs["ms_min"],
                "hp_peak_mib": hp["peak_mib"],
                "torch_peak_mib": theirs["peak_mib"],
                "ddp_peak_mib": ddp["peak_mib"],
                "hp_rest_mib": hp["rest_mib"],
                "torch_rest_mib": theirs["rest_mib"],
                "ddp_rest_mib": ddp["rest_mib"],
                "peak_hp_vs_torch": hp["peak_mib"] / theirs["peak_mib"],
                "copies_hp": hp["copies"],
                "copies_torch": theirs["copies"],
                "copies_ddp": ddp["copies"],
                "collectives_hp": hp["collectives"],
                "collectives_torch": theirs["collectives"],
                "collectives_ddp": ddp["collectives"],
            }
            comm = by.get((layout, "comm"))
            if comm is not None:
                # Where hp's step lies between everything overlapped (the floor) and nothing
                # overlapped (floor + its collectives alone): the share of them it hides.
                row["comm_ms"] = comm["ms"]
                row["hp_hidden_fraction"] = 1 - (hp["ms"] - floor["ms"]) / comm["ms"]
            rows.append(row)
            copies = f"{hp['copies']}/{theirs['copies']}"
            print(
                f"{layout:<10}{hp['ms']:>8.1f}{theirs['ms']:>10.1f}{row['hp_vs_torch']:>10.3f}"
                f"{row['hp_vs_ddp']:>8.2f}{row['torch_vs_ddp']:>10.2f}{hp['peak_mib']:>8.1f}"
                f"{theirs['peak_mib']:>10.1f}{row['peak_hp_vs_torch']:>9.2f}"
                f"{copies:>16}  "
                f"{_short(hp['collectives'])} | {_short(theirs['collectives'])}"
            )
            per_param = by.get((layout, "hp_per_param"))
            if per_param is not None:
                row["per_param_ms"] = per_param["ms"]
                row["per_param_vs_torch"] = per_param["ms"] / theirs["ms"]
                row["per_param_vs_flat"] = per_param["ms"] / hp["ms"]
                row["per_param_peak_mib"] = per_param["peak_mib"]
                row["copies_per_param"] = per_param["copies"]
                print(
                    f"{'  per_param':<10}{per_param['ms']:>8.1f}{'':>10}"
                    f"{row['per_param_vs_torch']:>10.3f}{per_param['ms'] / ddp['ms']:>8.2f}"
                    f"{'':>10}{per_param['peak_mib']:>8.1f}{'':>10}{'':>9}"
                    f"{per_param['copies']:>16}  {row['per_param_vs_flat']:.3f} x flat"
                )
        print(
            f"{f'DDP w{world}':<10}{'':>8}{'':>10}{'':>10}{ddp['ms']:>8.1f}{'ms':>10}"
            f"{'':>8}{ddp['peak_mib']:>10.1f}{'MiB':>9}{ddp['copies']:>16}  "
            f"{_short(ddp['collectives'])}"
        )
        print(
            f"{f'floor w{world}':<10}{'':>8}{'':>10}{'':>10}{floor['ms']:>8.1f}{'ms':>10}  "
            "each rank alone, no communication; over it: "
            + ", ".join(
                f"{r['layout']} hp {r['hp_vs_floor']:.2f} torch {r['torch_vs_floor']:.2f}"
                for r in rows
                if r["world"] == world
            )
            + f", DDP {ddp['ms'] / floor['ms']:.2f}"
        )
        for r in rows:
            if r["world"] == world and "comm_ms" in r:
                print(
                    f"{'  comm':<10}{r['comm_ms']:>8.1f} ms  {r['layout']}: hp-fsdp's collectives "
                    f"alone; floor + comm {r['floor_ms'] + r['comm_ms']:.1f} ms "
                    f"({(r['floor_ms'] + r['comm_ms']) / r['floor_ms']:.2f} x floor); hp hides "
                    f"{100 * r['hp_hidden_fraction']:.0f} % of it"
                )
    print(
        "ms: median over rounds of the mean step time (forward + backward + AdamW); hp/DDP and "
        f"torch/DDP: against DDP on the same world; MiB: peak during a step ({MEMORY_MEASURE}, "
        "rank 0); copies: copy kernels per step, model's own included; collectives per step "
        "(kind x group size)"
    )
    return rows


def _short(collectives: dict[str, int]) -> str:
    abbreviations = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    parts = []
    for key, calls in collectives.items():
        kind, size = key.split("/")
        parts.append(f"{calls}{abbreviations.get(kind, kind)}{size}")
    return " ".join(parts)


FORWARD_PREFETCH_ONLY = "--forward-prefetch-only" in sys.argv


def main() -> None:
    started = time.perf_counter()
    results = {world: _run_world(world) for world in WORLDS}
    c = CONFIG
    print(
        f"{machine_line()}; gloo ranks with 1 thread each; Llama dim {c.dim}, "
        f"{c.n_layers} layers, ffn {c.ffn_dim}, vocab {c.vocab_size}; batch {LOCAL_BATCH}x{SEQ} "
        f"per rank; {ROUNDS} interleaved rounds of {STEPS} steps"
    )
    rows = _table(results)
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "fsdp_step",
                "machine": machine_info(),
                "memory_measure": MEMORY_MEASURE,
                "hp_backward_prefetch": not FORWARD_PREFETCH_ONLY,
                "config": {
                    "dim": c.dim,
                    "n_layers": c.n_layers,
                    "ffn_dim": c.ffn_dim,
                    "vocab_size": c.vocab_size,
                    "local_batch": LOCAL_BATCH,
                    "seq": SEQ,
                },
                "first_loss": {w: r["first_loss"] for w, r in results.items()},
                "warmup_loss_spread": {w: r["warmup_loss_spread"] for w, r in results.items()},
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
