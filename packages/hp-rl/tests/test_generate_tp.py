"""``hp_rl.generate.generate`` under tensor parallelism 2 (world 2, gloo, production mode with
hp-train's ``tp_plan``): greedy tokens equal the single-rank run's, log-probabilities within
tolerance, and every TP rank holds the same logits and produces the same tokens; ranks seeded
differently are caught by the ``group`` check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import parallelize_module
from hp_layout import Mesh
from hp_rl.generate import generate
from hp_rl.sampling import SamplingParams
from hp_testing import run_on_ranks
from hp_train.config.schema import ModelConfig, MoEConfig
from hp_train.model.llama import Transformer
from hp_train.parallel.parallelize import tp_plan

MODELS = {
    "gqa_qk_norm": ModelConfig(
        vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
        max_seq_len=32, qk_norm=True,
    ),
    "tied": ModelConfig(
        vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
        max_seq_len=32, tie_embeddings=True,
    ),
    "moe": ModelConfig(
        vocab_size=48, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16, every=2, n_shared_experts=1),
    ),
}  # fmt: skip
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
PAD = 0
TOL = 1e-5


def _models(kind: str) -> tuple[Transformer, Transformer, DeviceMesh]:
    torch.set_num_threads(1)
    config = MODELS[kind]
    torch.manual_seed(0)
    whole = Transformer(config).eval()
    model = Transformer(config).eval()
    model.load_state_dict(whole.state_dict())
    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("tp",)))
    parallelize_module(model, mesh, tp_plan(config, model), mode="production", tp_axis="tp")
    return whole, model, mesh


def _tp_run(kind: str) -> dict[str, Any]:
    whole, model, mesh = _models(kind)
    group = mesh.get_group("tp")
    free = generate(whole, PROMPTS, SamplingParams(8, temperature=0.0), torch.Generator(),
                    pad_id=PAD)  # fmt: skip
    # Row 0's 4th token as a stop token: row 0 ends early, so rows leave the batch mid-way.
    greedy = SamplingParams(8, temperature=0.0, stop_tokens=(int(free.response[0, 3]),))
    reference = generate(whole, PROMPTS, greedy, torch.Generator(), pad_id=PAD)
    assert reference.finished[0]
    tp = generate(model, PROMPTS, greedy, torch.Generator(), pad_id=PAD, group=group)
    sampled = SamplingParams(8, temperature=1.0, top_p=0.9)
    drawn = generate(model, PROMPTS, sampled, torch.Generator().manual_seed(3), pad_id=PAD,
                     group=group)  # fmt: skip
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        logits = model(ids)
    # This rank's column shard of the first q projection: the ranks must hold different heads.
    q_width = model.layers["0"].attn.q_proj.weight.shape[0]  # type: ignore[union-attr,index]
    return {
        "reference": (reference.response, reference.response_logprobs, reference.finished),
        "tp": (tp.response, tp.response_logprobs, tp.finished, tp.response_lengths),
        "drawn": (drawn.response, drawn.response_logprobs),
        "logits": logits,
        "q_width": q_width,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(MODELS))
def test_tensor_parallel_generation_matches_one_rank_and_agrees_across_ranks(kind: str) -> None:
    results = run_on_ranks(2, _tp_run, kind, timeout=300)
    full_q = MODELS[kind].n_heads * MODELS[kind].head_dim
    for rank, r in enumerate(results):
        assert r["q_width"] == full_q // 2, f"rank {rank} is not tensor-parallel"
        ref_tokens, ref_logprobs, ref_finished = r["reference"]
        tokens, logprobs, finished, _ = r["tp"]
        assert torch.equal(tokens, ref_tokens), f"rank {rank}: TP greedy tokens differ"
        assert torch.equal(finished, ref_finished)
        torch.testing.assert_close(logprobs, ref_logprobs, atol=TOL, rtol=0)
    first, second = results
    # The gathered logits, and so everything generated from them, are bitwise equal on the
    # two ranks of the group.
    assert torch.equal(first["logits"], second["logits"])
    for key in ("tp", "drawn"):
        for a, b in zip(first[key], second[key], strict=True):
            assert torch.equal(a, b), key


def _differently_seeded() -> str:
    _, model, mesh = _models("gqa_qk_norm")
    seed = 100 + dist.get_rank()
    params = SamplingParams(6, temperature=1.5)
    try:
        generate(model, PROMPTS, params, torch.Generator().manual_seed(seed), pad_id=PAD,
                 group=mesh.get_group("tp"))  # fmt: skip
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_ranks_seeded_differently_are_caught_by_the_group_check() -> None:
    for message in run_on_ranks(2, _differently_seeded, timeout=300):
        assert "ranks [1]" in message
        assert "seed every rank's generator alike" in message
