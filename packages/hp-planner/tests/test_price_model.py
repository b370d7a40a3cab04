"""The :class:`~hp_planner.price.PricedModel` contract, through
:class:`~hp_planner.price.MetaModel`: a Hugging Face Llama built on ``meta`` priced without
hp-train.

Oracles: transformers' own parameter count, the activation formula of
:mod:`hp_planner.price.activation`'s docstring (written here), the fits rule ``MetaModel``
states (``tp`` divides the heads, the KV heads, a dense feed-forward and the vocabulary; no
pipelining), and what each refusal must name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hf_priced import HF_NAMES, llama_config
from hp_dtensor.parallel import transformer_tp_plan
from hp_planner import JobDims, ModelParallelism, PlanInputError, TrainingPolicy
from hp_planner.price import (
    BF16_MIXED,
    MetaModel,
    MoEDims,
    PricingError,
    StepShape,
    TransformerDims,
    dry_run,
    fsdp_groups,
    search,
    topology_preset,
)
from hp_planner.price.search import SearchSpace

transformers = pytest.importorskip("transformers")

CONFIG = llama_config()
SHAPE = TransformerDims(
    vocab_size=CONFIG.vocab_size,
    dim=CONFIG.hidden_size,
    n_layers=CONFIG.num_hidden_layers,
    n_heads=CONFIG.num_attention_heads,
    n_kv_heads=CONFIG.num_key_value_heads,
    head_dim=CONFIG.hidden_size // CONFIG.num_attention_heads,
    ffn_dim=CONFIG.intermediate_size,
)
BUILDS: list[int] = []


def _build() -> nn.Module:
    BUILDS.append(1)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(CONFIG)  # type: ignore[no-any-return]


def _parallelism(dims: JobDims) -> ModelParallelism:
    del dims
    return ModelParallelism.of(transformer_tp_plan(names=HF_NAMES), fsdp_units=("model.layers.*",))


def _meta_model(shape: Any = SHAPE, **kw: Any) -> MetaModel:
    return MetaModel(
        shape=shape,
        build=_build,
        parallelism_for=_parallelism,
        training=TrainingPolicy(optimizer="muon"),
        blocks="model.layers",
        embedding="model.embed_tokens",
        head="lm_head",
        **kw,
    )


MODEL = _meta_model()
STEP = StepShape(global_batch=8, seq_len=16, precision=BF16_MIXED)


def _hf_count() -> int:
    model: Any = _build()  # transformers' PreTrainedModel
    return int(model.num_parameters())


def _block_bytes(tokens: int, tp: int, cb: int) -> int:
    """A dense block's kept bytes under ``none`` (flash): the norms' ``3 dim`` and reciprocal
    RMS each, q/k/v expanded and the attention output ``4 q / tp``, SwiGLU ``4 ffn / tp``,
    the fp32 log-sum-exp per head."""
    s = SHAPE
    q = s.n_heads * s.head_dim
    return tokens * ((6 * s.dim + 2 + 4 * q // tp + 4 * s.ffn_dim // tp) * cb + s.n_heads // tp * 4)


@pytest.mark.parametrize(
    "dims", [JobDims(dp_shard=4), JobDims(dp_shard=2, tp=2), JobDims(dp_replicate=2, dp_shard=2)],
    ids=repr,
)  # fmt: skip
def test_a_meta_model_prices_a_dry_run_without_hp_train(dims: JobDims) -> None:
    result = dry_run(MODEL, dims, topology_preset("single_host:4"), STEP, model_name="hf-llama")
    count = _hf_count()
    assert result.parameters == count
    assert result.model is MODEL
    assert result.microbatch_size == 8 // dims.dp
    assert len(result.stages) == 1
    mem = result.memory
    # fp32 shards of every parameter (at least tp's share of each), 16-byte aligned per
    # parameter, padded to whole chunks.
    held = mem.parameters // 4 * dims.dp_shard
    n_params = len(list(_build().parameters()))
    assert (
        count // dims.tp <= held <= count + 4 * n_params + 4 * dims.dp_shard * (SHAPE.n_layers + 1)
    )
    assert mem.gradients == mem.parameters  # fp32 reduce dtype
    tokens = result.microbatch_size * STEP.seq_len
    blocks = [f"model.layers.{i}" for i in range(SHAPE.n_layers)]
    assert [name for name, _ in mem.activations_by_layer] == [*blocks, "head"]
    per_block = _block_bytes(tokens, dims.tp, 2)
    assert [b for _, b in mem.activations_by_layer[:-1]] == [per_block] * SHAPE.n_layers
    # Tensor-parallel collectives only with tp.
    calls = result.kind("tp").calls
    assert calls > 0 if dims.tp > 1 else calls == 0


def test_the_meta_model_is_one_stage() -> None:
    for call in (
        lambda: MODEL.stage_models(2),
        lambda: MODEL.stage_boundaries(3),
        lambda: MODEL.check_fits(JobDims(pp=2)),
    ):
        with pytest.raises(PricingError, match=r"pp=\d: a MetaModel is one module"):
            call()
    before = len(BUILDS)
    (model,) = MODEL.stage_models(1)
    assert len(BUILDS) == before + 1
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert MODEL.stage_boundaries(1) == (0, SHAPE.n_layers)
    with pytest.raises(PricingError, match="pp=2"):
        dry_run(MODEL, JobDims(dp_shard=2, pp=2), topology_preset("single_host:4"), STEP)
    with pytest.raises(PricingError, match="pp=2"):
        fsdp_groups(MODEL, 2, 1, pp=2)


def test_the_meta_model_answers_with_what_it_was_given() -> None:
    dims = JobDims(dp_shard=2, tp=2)
    assert MODEL.parallelism(dims) == _parallelism(dims)
    assert MODEL.policy() == TrainingPolicy(optimizer="muon")
    assert (MODEL.blocks, MODEL.embedding, MODEL.head) == (
        "model.layers",
        "model.embed_tokens",
        "lm_head",
    )
    assert MODEL.shape is SHAPE
    # Compared by identity: two instances are two models (the pricing caches per model).
    twin = _meta_model()
    assert twin != MODEL
    assert twin == twin
    assert len({twin, MODEL}) == 2
    # The defaults are hp-train's names and a policy that refuses nothing.
    bare = MetaModel(SHAPE, _build, _parallelism)
    assert (bare.blocks, bare.embedding, bare.head) == ("layers", "tok_embeddings", "output")
    bare.check_accepts(JobDims(), STEP)
    assert bare.policy() == TrainingPolicy()


@pytest.mark.parametrize(
    ("shape", "tp", "named"),
    [
        (SHAPE, 3, "n_heads=4"),
        (SHAPE, 4, "n_kv_heads=2"),
        (TransformerDims(256, 64, 2, 8, 8, 8, ffn_dim=100), 8, "ffn_dim=100"),
        (TransformerDims(251, 64, 2, 4, 2, 16, ffn_dim=128), 2, "vocab_size=251"),
    ],
)
def test_check_fits_refuses_a_tp_that_does_not_divide(
    shape: TransformerDims, tp: int, named: str
) -> None:
    model = _meta_model(shape)
    with pytest.raises(PricingError, match=f"tp={tp} must divide {named}"):
        model.check_fits(JobDims(tp=tp))


def test_check_fits_skips_the_feed_forward_when_every_block_is_moe() -> None:
    moe = MoEDims(n_experts=4, top_k=2, expert_ffn_dim=30)
    every = TransformerDims(256, 64, 2, 8, 8, 8, ffn_dim=100, moe=moe)
    _meta_model(every).check_fits(JobDims(tp=8))  # no dense feed-forward to split
    some = TransformerDims(256, 64, 2, 8, 8, 8, ffn_dim=100, moe=MoEDims(4, 2, 30, every=2))
    with pytest.raises(PricingError, match="ffn_dim=100"):
        _meta_model(some).check_fits(JobDims(tp=8))
    _meta_model(SHAPE).check_fits(JobDims(dp_shard=8, tp=2))


def test_pricing_error_is_a_plan_input_error() -> None:
    assert issubclass(PricingError, PlanInputError)
    assert issubclass(PricingError, ValueError)
    with pytest.raises(PlanInputError):
        MODEL.check_fits(JobDims(tp=3))
    with pytest.raises(ValueError, match="tp=3"):
        MODEL.check_fits(JobDims(tp=3))


def _refuse_fp8(dims: JobDims, step: StepShape) -> None:
    if step.fp8 != "none":
        raise PricingError(f"fp8={step.fp8!r} is not run by this test trainer (dp={dims.dp})")


@pytest.mark.parametrize(
    ("dims", "step", "named"),
    [
        (JobDims(dp_shard=4, tp=3), STEP, "tp=3 must divide n_heads=4"),
        (JobDims(dp_shard=2), STEP, "world"),
        (JobDims(dp_shard=4), StepShape(global_batch=6, seq_len=16), "global_batch=6"),
        (
            JobDims(dp_shard=4),
            StepShape(global_batch=8, seq_len=16, microbatches=3),
            "microbatches=3",
        ),
        (JobDims(dp_shard=4), StepShape(8, 16, fp8="tensorwise"), "fp8='tensorwise'"),
    ],
)
def test_a_refused_configuration_names_what_was_wrong(
    dims: JobDims, step: StepShape, named: str
) -> None:
    model = _meta_model(accepts=_refuse_fp8)
    topology = topology_preset("single_host:12" if dims.tp == 3 else "single_host:4")
    with pytest.raises(PricingError, match=named):
        dry_run(model, dims, topology, step)


def test_the_models_refusals_apply_to_its_own_runtime_only() -> None:
    model = _meta_model(accepts=_refuse_fp8)
    step = StepShape(8, 16, fp8="tensorwise", runtime="torch_fsdp2")
    result = dry_run(model, JobDims(dp_shard=4), topology_preset("single_host:4"), step)
    assert result.parameters == _hf_count()


def test_the_search_ranks_a_meta_models_layouts() -> None:
    """The tp (4 does not divide the KV heads) and pp the model refuses are skipped; the rest
    are priced under every policy and ranked."""
    space = SearchSpace(
        dp_replicate=(1,), tp=(1, 2, 4), pp=(1, 2), cp=(1,), ep=(1,), microbatches=(1,)
    )
    result = search(MODEL, topology_preset("single_host:4"), STEP, 2**40, space=space)
    layouts = {(r.parallel.tp, r.parallel.pp) for r in result.fitting}
    assert layouts == {(1, 1), (2, 1)}
    assert result.evaluated == 2 * len(space.ac)
    times = [r.time.total for r in result.fitting]
    assert times == sorted(times)
