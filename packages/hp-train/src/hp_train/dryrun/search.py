"""``--search``: every way to lay a model onto a topology, ranked by predicted step time.

Enumerated: ``dp_replicate x dp_shard x tp x pp == world`` that the trainer accepts
(``hp_train.parallelize.check_model_fits``: ``tp`` dividing the attention heads, the KV heads,
the dense feed-forward and the vocabulary, ``pp <= n_layers``), the global batch divisible by
``dp``; microbatch
counts from ``microbatch_options`` that divide the per-rank batch; recomputation off and on.
A configuration fits when its largest stage's peak memory
(:attr:`~hp_train.dryrun.memory.MemoryBreakdown.total`) is at most the limit. Muon traffic is
analytic here (fast); pipeline stages are sampled as in ``dry_run(all_stages=False)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hp_layout import Topology
from hp_train.config import ModelConfig, ParallelConfig
from hp_train.dryrun.planner import DryRun, dry_run
from hp_train.dryrun.presets import Device, DryRunError
from hp_train.dryrun.shapes import check_fits
from hp_train.dryrun.workload import StepShape

__all__ = ["SearchResult", "divisors", "parallel_configs", "search"]


@dataclass(frozen=True)
class SearchResult:
    """The outcome of a search.

    Attributes:
        fitting: configurations that fit, fastest first.
        evaluated: configurations evaluated.
        rejected: how many did not fit the memory limit.
        memory_limit: the per-rank limit in bytes.
        smallest_rejected: the least peak memory among rejected ones (bytes; 0 when none).
    """

    fitting: tuple[DryRun, ...]
    evaluated: int
    rejected: int
    memory_limit: int
    smallest_rejected: int


def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of ``n``, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def parallel_configs(model: ModelConfig, world: int, global_batch: int) -> list[ParallelConfig]:
    """Every ``(dp_replicate, dp_shard, tp, pp)`` for ``world`` ranks the model (as the trainer
    checks it) and batch allow."""
    out: list[ParallelConfig] = []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            try:
                check_fits(model, ParallelConfig(tp=tp, pp=pp))
            except DryRunError:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            out.extend(ParallelConfig(r, dp // r, tp, pp) for r in divisors(dp))
    return out


def search(
    model: ModelConfig,
    topology: Topology,
    shape: StepShape,
    memory_limit: int,
    *,
    device: Device | None = None,
    microbatch_options: Sequence[int] = (1, 2, 4, 8, 16),
    model_name: str = "custom",
) -> SearchResult:
    """Enumerate, predict, reject what does not fit in ``memory_limit`` bytes, rank by time.

    ``shape`` gives the batch, precision and optimizer; its ``microbatches`` and ``recompute``
    are searched over.

    Postconditions: every result in ``fitting`` has ``memory.total <= memory_limit`` and the
    results are sorted by ``time.total``, ascending.

    Raises:
        DryRunError: ``memory_limit`` is not positive, or no configuration exists for the
            world size (the message says why).
    """
    if memory_limit <= 0:
        raise DryRunError(f"the memory limit must be positive, got {memory_limit} bytes")
    world = topology.world_size
    configs = parallel_configs(model, world, shape.global_batch)
    if not configs:
        raise DryRunError(
            f"no (dp_replicate, dp_shard, tp, pp) for {world} ranks: tp must divide n_heads="
            f"{model.n_heads}, n_kv_heads={model.n_kv_heads}, ffn_dim={model.ffn_dim} and "
            f"vocab_size={model.vocab_size}, pp at most n_layers={model.n_layers}, and "
            f"global_batch={shape.global_batch} must be divisible by dp"
        )
    fitting: list[DryRun] = []
    evaluated = rejected = 0
    smallest = 0
    for parallel in configs:
        local = shape.global_batch // parallel.dp
        for m in microbatch_options:
            if local % m or (parallel.pp > 1 and m < parallel.pp):
                continue
            for recompute in (False, True):
                candidate = replace(shape, microbatches=m, recompute=recompute)
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
                evaluated += 1
                if result.memory.total <= memory_limit:
                    fitting.append(result)
                else:
                    rejected += 1
                    total = result.memory.total
                    smallest = total if not smallest else min(smallest, total)
    fitting.sort(key=lambda r: r.time.total)
    return SearchResult(tuple(fitting), evaluated, rejected, memory_limit, smallest)
