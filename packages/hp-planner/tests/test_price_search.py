"""``search`` against brute force on a small space: every layout of 4 ranks enumerated here
(every product of degrees, expert parallelism dividing the shard axis and the experts, both
context-parallel variants, expert-tensor parallelism on and off), every microbatch count,
policy and swap setting, each priced by ``dry_run`` itself. The search must evaluate the same
configurations, keep exactly those within the limit (the limit set to one of them, so ``<=``
and ``<`` differ) and rank the fastest first.

The model is nobody's here: Hugging Face's ``LlamaForCausalLM`` (``hf_priced``) whose second
block's feed-forward is hp-testing's MoE layer (hp-dtensor's expert protocol, so expert
parallelism shards it), with its attention modules as context parallelism's (parameter-free
to the plan): :class:`LlamaWithExperts`, a :class:`~hp_planner.price.PricedModel` that plans
every degree, ``ep`` and ``cp`` included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from hf_priced import HF_NAMES, HFPriced, llama_config
from hp_dtensor.parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    ParallelStyle,
    transformer_tp_plan,
)
from hp_layout import Topology
from hp_planner import JobDims, ModelParallelism, PlanInputError, TrainingPolicy
from hp_planner.price import (
    DryRun,
    MoEDims,
    PricingError,
    SearchSpace,
    StepShape,
    TransformerDims,
    dry_run,
    search,
)
from hp_testing.moe import MoE

#: The expert mesh's axes (``hp_planner.meshes``: ``ep`` carved from the shard axis).
EXPERT_AXES = ("dp_replicate", "expert_shard", "ep", "tp")


@dataclass(frozen=True, eq=False)
class LlamaWithExperts(HFPriced):
    """A Hugging Face Llama whose every ``every``-th block (1-based) has hp-testing's MoE
    layer as its ``mlp`` (``n_experts`` SwiGLU experts of width ``expert_ffn``, ``top_k`` per
    token, one shared expert as wide). Pipeline stages keep the blocks' global names (the
    dropped blocks are left out of a ``ModuleDict``). Compared by identity."""

    n_experts: int = 4
    top_k: int = 2
    expert_ffn: int = 32
    every: int = 2

    @property
    def shape(self) -> TransformerDims:
        moe = MoEDims(
            n_experts=self.n_experts,
            top_k=self.top_k,
            expert_ffn_dim=self.expert_ffn,
            n_shared_experts=1,
            every=self.every,
        )
        return replace(super().shape, moe=moe)

    def _moe_blocks(self) -> tuple[int, ...]:
        n = self.config.num_hidden_layers
        return tuple(i for i in range(n) if (i + 1) % self.every == 0)

    def _build(self) -> Any:
        model = super()._build()  # a Hugging Face model: its submodules by name
        with torch.device("meta"):
            for i in self._moe_blocks():
                model.model.layers[i].mlp = MoE(
                    self.config.hidden_size,
                    self.expert_ffn,
                    self.n_experts,
                    self.top_k,
                    shared_hidden=self.expert_ffn,
                )
        return model

    def parallelism(self, dims: JobDims) -> ModelParallelism:
        plan: dict[str, ParallelStyle] = transformer_tp_plan(names=HF_NAMES)
        experts: tuple[str, ...] = ()
        style: ParallelStyle | None = None
        if dims.ep > 1:
            experts = tuple(f"model.layers.{i}.mlp" for i in self._moe_blocks())
            style = (
                ExpertTensorParallel(mesh_axes=EXPERT_AXES, ep_axis="ep", tp_axis="tp")
                if dims.ep_tp
                else ExpertParallel()
            )
        return ModelParallelism.of(
            plan,
            fsdp_units=("model.layers.*",),
            expert_modules=experts,
            expert_style=style,
            context_modules=("model.layers.*.self_attn",) if dims.cp > 1 else (),
        )

    def policy(self) -> TrainingPolicy:
        return TrainingPolicy(optimizer="muon", adamw_patterns=("*.mlp.router.*",))

    def check_fits(self, dims: JobDims) -> None:
        shape = self.shape
        for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            if getattr(shape, name) % dims.tp:
                raise PricingError(f"tp={dims.tp} must divide {name}={getattr(shape, name)}")
        if dims.pp > shape.n_layers:
            raise PricingError(f"pp={dims.pp} exceeds n_layers={shape.n_layers}")
        if self.n_experts % dims.ep:
            raise PricingError(f"ep={dims.ep} must divide n_experts={self.n_experts}")


MODEL = LlamaWithExperts(llama_config(num_hidden_layers=2))
TOPOLOGY = Topology.two_tier_cluster(2, 2)
SHAPE = StepShape(global_batch=8, seq_len=64, optimizer="adamw")
MICROBATCHES = (1, 2)
POLICIES = (("none", False), ("full", False), ("none", True))

Key = tuple[JobDims, int, str, bool]


def _key(run: DryRun) -> Key:
    return (run.parallel, run.shape.microbatches, run.shape.ac, run.shape.swap)


def _every_configuration() -> dict[Key, DryRun]:
    """What ``dry_run`` accepts of every layout, microbatch count and policy of 4 ranks (at
    least ``pp`` microbatches when pipelining, as the search's space says)."""
    out: dict[Key, DryRun] = {}
    degrees = range(1, 5)
    for r, shard, tp, pp, cp in itertools.product(degrees, repeat=5):
        if r * shard * tp * pp * cp != 4:
            continue
        # Every expert-parallel degree the layout can carve from dp_shard x cp (the rest is
        # refused by JobDims, which the search must not return either).
        for ep in (e for e in degrees if (shard * cp) % e == 0 and MODEL.n_experts % e == 0):
            for variant in ("ring", "ulysses") if cp > 1 else ("ring",):
                for ep_tp in (False, True) if ep > 1 and tp > 1 else (False,):
                    try:
                        parallel = JobDims(r, shard, tp, pp, cp, variant, ep, ep_tp)
                    except PlanInputError:
                        continue
                    for m, (ac, swap) in itertools.product(MICROBATCHES, POLICIES):
                        if pp > 1 and m < pp:
                            continue
                        shape = replace(SHAPE, microbatches=m, ac=ac, swap=swap)
                        try:
                            run = dry_run(
                                MODEL, parallel, TOPOLOGY, shape, muon_exact=False, all_stages=False
                            )
                        except PricingError:
                            continue
                        out[_key(run)] = run
    return out


def test_the_model_plans_expert_and_context_parallelism() -> None:
    """The MoE block's experts are a group of their own under ``ep`` (before their block's),
    and a block's parameters are those of Hugging Face's block with hp-testing's layer."""
    run = dry_run(MODEL, JobDims(dp_shard=4, ep=2), TOPOLOGY, SHAPE)
    names = [g.name for g in run.stages[0].groups]
    assert names == ["model.layers.0", "model.layers.1.mlp", "model.layers.1", "root"]
    experts = run.stages[0].groups[1]
    assert experts.is_experts
    assert experts.block == 1
    d, h, e = 64, MODEL.expert_ffn, MODEL.n_experts
    # Two of the four experts' three stacks on the rank; the router and the shared expert.
    assert sum(s.numel for s in experts.params) == 3 * e * h * d + e * d + 3 * h * d
    assert sum(sum(x) for x in (experts.local_numels(0), experts.local_numels(1))) == (
        3 * e // 2 * h * d + e * d + 3 * h * d
    )
    context = dry_run(MODEL, JobDims(dp_shard=2, cp=2, cp_variant="ulysses"), TOPOLOGY, SHAPE)
    assert context.kind("cp").calls > 0


def test_search_finds_the_brute_force_optimum() -> None:
    every = _every_configuration()
    assert len({k[0].ep_tp for k in every}) == len({k[0].cp_variant for k in every}) == 2
    totals = sorted(run.memory.total for run in every.values())
    limit = totals[len(totals) // 2]
    space = SearchSpace(microbatches=MICROBATCHES, ac=("none", "full"), swap=(False, True))
    result = search(MODEL, TOPOLOGY, SHAPE, limit, space=space)
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
