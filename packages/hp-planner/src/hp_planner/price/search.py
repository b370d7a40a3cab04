"""``--search``: every way to lay a model onto a topology, ranked by predicted step time.

Enumerated (:class:`SearchSpace`, by default every divisor): ``dp_replicate x dp_shard x cp x
tp x pp == world`` with ``ep`` carved from ``dp_shard x cp`` (dividing it and the experts; a
multiple of ``cp``: :func:`~hp_planner.inputs.expert_carving_problem`), that the trainer
accepts (``PricedModel.check_fits``: for a trainer's model, ``tp`` dividing the attention
heads, the KV heads, the dense feed-forward and the vocabulary, ``pp <= n_layers``; and
``PricedModel.check_accepts``: the pairs the runtime refuses, such as ``--swap`` with full
recomputation), the global batch divisible by ``dp``; microbatch counts that divide the
per-rank batch (at least ``pp`` of them when pipelining); the checkpointing policies of the
space. A configuration fits when its largest stage's peak memory
(:attr:`~hp_planner.price.memory.MemoryBreakdown.total`) is at most the limit. Muon traffic is
analytic here (fast); pipeline stages are sampled as in ``dry_run(all_stages=False)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hp_layout import Topology
from hp_planner.inputs import CP_VARIANTS, JobDims, expert_carving_problem
from hp_planner.price.devices import Device
from hp_planner.price.model import PricedModel, PricingError
from hp_planner.price.run import DryRun, dry_run
from hp_planner.price.structure import check_fits
from hp_planner.price.workload import StepShape

__all__ = [
    "SWAPPABLE_POLICIES",
    "SearchResult",
    "SearchSpace",
    "divisors",
    "parallel_configs",
    "search",
]

SWAPPABLE_POLICIES = ("none", "selective")
"""The checkpointing policies the trainer swaps under (it refuses ``--swap`` with the rest)."""


@dataclass(frozen=True)
class SearchResult:
    """The outcome of a search.

    Attributes:
        fitting: configurations that fit, fastest first.
        evaluated: configurations evaluated.
        rejected: how many did not fit the memory limit.
        memory_limit: the per-rank limit in bytes.
        smallest_rejected: the least peak memory among rejected ones (bytes; 0 when none).
        refused: layouts skipped because the trainer refuses them.
        closest: the rejected configuration needing the least memory (None when none was).
    """

    fitting: tuple[DryRun, ...]
    evaluated: int
    rejected: int
    memory_limit: int
    smallest_rejected: int
    refused: int = 0
    closest: DryRun | None = None


@dataclass(frozen=True)
class SearchSpace:
    """What the search enumerates; ``None`` for a degree: every divisor of what is left.

    Attributes:
        dp_replicate, tp, ep, cp, pp: allowed degrees (``dp_shard`` takes the rest).
        cp_variants: context-parallel attentions tried when ``cp > 1``.
        ep_tp: expert-tensor parallelism settings tried when ``ep > 1`` and ``tp > 1``.
        microbatches: microbatch counts.
        ac: checkpointing policies.
        swap: activation swap settings tried with each policy that can swap (``none``,
            ``selective``).
    """

    dp_replicate: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp_variants: tuple[str, ...] = CP_VARIANTS
    ep_tp: tuple[bool, ...] = (False, True)
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    ac: tuple[str, ...] = ("none", "selective", "full")
    swap: tuple[bool, ...] = (False,)


def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of ``n``, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _allowed(options: tuple[int, ...] | None, n: int) -> tuple[int, ...]:
    return tuple(d for d in (divisors(n) if options is None else options) if n % d == 0)


def _layouts(model: PricedModel, world: int, space: SearchSpace) -> Iterator[JobDims]:
    moe = model.shape.moe
    experts = moe.n_experts if moe is not None else 1
    for tp in _allowed(space.tp, world):
        for pp in _allowed(space.pp, world // tp):
            for cp in _allowed(space.cp, world // (tp * pp)):
                dp = world // (tp * pp * cp)
                for r in _allowed(space.dp_replicate, dp):
                    shard = dp // r
                    for ep in _allowed(space.ep, shard * cp):
                        if experts % ep or expert_carving_problem(shard, cp, ep) is not None:
                            continue
                        variants = space.cp_variants if cp > 1 else ("ring",)
                        splits = space.ep_tp if ep > 1 and tp > 1 else (False,)
                        for variant in variants:
                            for ep_tp in splits:
                                yield JobDims(r, shard, tp, pp, cp, variant, ep, ep_tp)


def parallel_configs(
    model: PricedModel,
    world: int,
    global_batch: int,
    space: SearchSpace | None = None,
    shape: StepShape | None = None,
) -> list[JobDims]:
    """Every layout of ``space`` for ``world`` ranks the model (its own check), the batch and,
    given ``shape``, the runtime's refused pairs allow."""
    out: list[JobDims] = []
    for parallel in _layouts(model, world, space or SearchSpace()):
        if global_batch % parallel.dp:
            continue
        try:
            check_fits(model, parallel)
            if shape is not None and shape.runtime == "hp":
                model.check_accepts(parallel, shape)
        except PricingError:
            continue
        out.append(parallel)
    return out


def search(
    model: PricedModel,
    topology: Topology,
    shape: StepShape,
    memory_limit: int,
    *,
    device: Device | None = None,
    microbatch_options: tuple[int, ...] | None = None,
    space: SearchSpace | None = None,
    model_name: str = "custom",
) -> SearchResult:
    """Enumerate, predict, reject what does not fit in ``memory_limit`` bytes, rank by time.

    ``shape`` gives the batch, precision, optimizer, offload and FP8 options; its
    ``microbatches``, ``ac`` and ``swap`` are searched over (``space``;
    ``microbatch_options`` overrides its microbatch counts).

    Postconditions: every result in ``fitting`` has ``memory.total <= memory_limit`` and the
    results are sorted by ``time.total``, ascending.

    Raises:
        PricingError: ``memory_limit`` is not positive, or no configuration exists for the
            world size (the message says why).
    """
    if memory_limit <= 0:
        raise PricingError(f"the memory limit must be positive, got {memory_limit} bytes")
    space = space or SearchSpace()
    if microbatch_options is not None:
        space = replace(space, microbatches=tuple(microbatch_options))
    world = topology.world_size
    base = replace(shape, microbatches=1, ac="none")
    configs = parallel_configs(model, world, shape.global_batch, space)
    if not configs:
        dims = model.shape
        raise PricingError(
            f"no (dp_replicate, dp_shard, cp, tp, pp) for {world} ranks: tp must divide n_heads="
            f"{dims.n_heads}, n_kv_heads={dims.n_kv_heads}, ffn_dim={dims.ffn_dim} and "
            f"vocab_size={dims.vocab_size}, pp at most n_layers={dims.n_layers}, and "
            f"global_batch={shape.global_batch} must be divisible by dp"
        )
    fitting: list[DryRun] = []
    evaluated = rejected = refused = 0
    smallest = 0
    closest: DryRun | None = None
    for parallel in configs:
        local = shape.global_batch // parallel.dp
        for m in space.microbatches:
            if local % m or (parallel.pp > 1 and m < parallel.pp):
                continue
            for ac, swap in itertools.product(space.ac, space.swap):
                if swap and ac not in SWAPPABLE_POLICIES:
                    continue
                candidate = replace(base, microbatches=m, ac=ac, swap=swap)
                try:
                    result = dry_run(
                        model,
                        parallel,
                        topology,
                        candidate,
                        device=device,
                        muon_exact=False,
                        model_name=model_name,
                        all_stages=False,
                    )
                except PricingError:
                    refused += 1
                    continue
                evaluated += 1
                if result.memory.total <= memory_limit:
                    fitting.append(result)
                else:
                    rejected += 1
                    total = result.memory.total
                    if not smallest or total < smallest:
                        smallest, closest = total, result
    fitting.sort(key=lambda r: r.time.total)
    return SearchResult(
        tuple(fitting), evaluated, rejected, memory_limit, smallest, refused, closest
    )
