"""``search`` against brute force on a small space: every layout of 4 ranks enumerated here
(every product of degrees, expert parallelism dividing the shard axis and the experts, both
context-parallel variants, expert-tensor parallelism on and off), every microbatch count,
policy and swap setting, each evaluated by ``dry_run`` itself. The search must evaluate the
same configurations, keep exactly those within the limit (the limit set to one of them, so
``<=`` and ``<`` differ) and rank the fastest first."""

from __future__ import annotations

import itertools

from hp_layout import Topology
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig
from hp_train.dryrun import DryRun, DryRunError, SearchSpace, StepShape, dry_run, search

MOE = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=64,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, every=2, n_shared_experts=1),
)
TOPOLOGY = Topology.two_tier_cluster(2, 2)
SHAPE = StepShape(global_batch=8, seq_len=64, optimizer="adamw")
MICROBATCHES = (1, 2)
POLICIES = (("none", False), ("full", False), ("none", True))

Key = tuple[ParallelConfig, int, str, bool]


def _key(run: DryRun) -> Key:
    return (run.parallel, run.shape.microbatches, run.shape.ac, run.shape.swap)


def _every_configuration() -> dict[Key, DryRun]:
    """What ``dry_run`` accepts of every layout, microbatch count and policy of 4 ranks (at
    least ``pp`` microbatches when pipelining, as the search's space says)."""
    out: dict[Key, DryRun] = {}
    degrees = range(1, 5)
    assert MOE.moe is not None
    experts = MOE.moe.n_experts
    for r, shard, tp, pp, cp in itertools.product(degrees, repeat=5):
        if r * shard * tp * pp * cp != 4:
            continue
        for ep in (e for e in degrees if shard % e == 0 and experts % e == 0):
            for variant in ("ring", "ulysses") if cp > 1 else ("ring",):
                for ep_tp in (False, True) if ep > 1 and tp > 1 else (False,):
                    parallel = ParallelConfig(r, shard, tp, pp, cp, variant, ep, ep_tp)
                    for m, (ac, swap) in itertools.product(MICROBATCHES, POLICIES):
                        if pp > 1 and m < pp:
                            continue
                        shape = StepShape(
                            8, 64, microbatches=m, ac=ac, optimizer="adamw", swap=swap
                        )
                        try:
                            run = dry_run(
                                MOE, parallel, TOPOLOGY, shape, muon_exact=False, all_stages=False
                            )
                        except DryRunError:
                            continue
                        out[_key(run)] = run
    return out


def test_search_finds_the_brute_force_optimum() -> None:
    every = _every_configuration()
    assert len({k[0].ep_tp for k in every}) == len({k[0].cp_variant for k in every}) == 2
    totals = sorted(run.memory.total for run in every.values())
    limit = totals[len(totals) // 2]
    space = SearchSpace(microbatches=MICROBATCHES, ac=("none", "full"), swap=(False, True))
    result = search(MOE, TOPOLOGY, SHAPE, limit, space=space)
    fits = {k for k, run in every.items() if run.memory.total <= limit}
    assert result.evaluated == len(every)
    assert {_key(run) for run in result.fitting} == fits
    assert result.rejected == len(every) - len(fits)
    assert result.smallest_rejected == min(
        run.memory.total for run in every.values() if run.memory.total > limit
    )
    fastest = min(every[k].time.total for k in fits)
    assert result.fitting[0].time.total == fastest
    assert [r.time.total for r in result.fitting] == sorted(every[k].time.total for k in fits)
