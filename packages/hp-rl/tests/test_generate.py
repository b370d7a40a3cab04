"""``hp_rl.generate.generate`` on one rank: greedy tokens against a brute-force full forward
of each row's own prefix, log-probabilities against ``sequence_logprobs`` of the joined
sequences, batching invariance, stop tokens, the length limit, sampling and errors; on dense,
grouped-query + qk-norm, tied-embedding and MoE models.

The brute force runs ``model(prefix)`` (no cache, no padding) on each row alone.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import hp_rl.generate as generate_module
from hp_rl.generate import Generation, generate
from hp_rl.sampling import SamplingParams
from hp_rl.scoring import join, sequence_logprobs
from hp_train.config.schema import ModelConfig, MoEConfig
from hp_train.model.llama import Transformer

VOCAB = 48
MODELS = {
    "dense": ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=40
    ),
    "gqa_qk_norm": ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
        max_seq_len=40, qk_norm=True, qkv_bias=True,
    ),
    "tied": ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=48,
        max_seq_len=40, tie_embeddings=True,
    ),
    "moe": ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
        max_seq_len=40,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16, every=1, n_shared_experts=1),
    ),
}  # fmt: skip
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
PAD = 0
# fp32: the cached (incremental) computation differs from the full forward by rounding only;
# measured max 4.8e-7, mean 1e-7 on these models (24 new tokens).
LOGPROB_TOL = 1e-5


def _model(kind: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(MODELS[kind]).eval()


def _brute_force_greedy(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards of the growing prefix, one row, no cache."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq]))[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(prompt) :]


def _rows(gen: Generation) -> list[list[int]]:
    return [gen.response[b, : int(n)].tolist() for b, n in enumerate(gen.response_lengths.tolist())]


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_are_the_argmax_of_a_full_forward_of_each_prefix(kind: str) -> None:
    model = _model(kind)
    steps = 9
    gen = generate(model, PROMPTS, SamplingParams(steps, temperature=0.0), torch.Generator(),
                   pad_id=PAD)  # fmt: skip
    assert gen.response.shape == (len(PROMPTS), steps)
    for b, prompt in enumerate(PROMPTS):
        assert gen.response[b].tolist() == _brute_force_greedy(model, prompt, steps), f"row {b}"
    assert gen.prompt_lengths.tolist() == [len(p) for p in PROMPTS]
    assert gen.response_lengths.tolist() == [steps] * len(PROMPTS)
    assert not gen.finished.any()


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_sequence_logprobs_of_the_joined_sequences(
    kind: str, temperature: float
) -> None:
    model = _model(kind)
    params = SamplingParams(8, temperature=temperature, top_k=10)
    gen = generate(model, PROMPTS, params, torch.Generator().manual_seed(5), pad_id=PAD)
    seqs = join(PROMPTS, gen, PAD)
    with torch.no_grad():
        full = sequence_logprobs(model, seqs.tokens, params.logprob_temperature)
    for b, p in enumerate(len(q) for q in PROMPTS):
        n = int(gen.response_lengths[b])
        want = full[b, p - 1 : p - 1 + n]
        torch.testing.assert_close(gen.response_logprobs[b, :n], want, atol=LOGPROB_TOL, rtol=0)
    # The mask picks exactly those positions, in order.
    picked = full[seqs.response_mask]
    flat = torch.cat([gen.response_logprobs[b, : int(n)] for b, n in enumerate(
        gen.response_lengths.tolist())])  # fmt: skip
    torch.testing.assert_close(flat, picked, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("kind", ["gqa_qk_norm", "moe"])
def test_a_row_in_a_mixed_batch_equals_the_row_alone(kind: str) -> None:
    model = _model(kind)
    params = SamplingParams(7, temperature=0.0)
    batch = generate(model, PROMPTS, params, torch.Generator(), pad_id=PAD)
    for b, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], params, torch.Generator(), pad_id=PAD)
        assert batch.response[b].tolist() == alone.response[0].tolist(), f"row {b}"
        torch.testing.assert_close(
            batch.response_logprobs[b], alone.response_logprobs[0], atol=LOGPROB_TOL, rtol=0
        )


def _textbook_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked with -inf) v, key/value head i serving query heads
    i * g .. (i + 1) * g - 1: a fully masked row is NaN here (0 / 0), as in older torch
    versions and some backends."""
    if enable_gqa:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(scores.masked_fill(~attn_mask, -math.inf), dim=-1) @ v


@pytest.mark.parametrize("kind", ["gqa_qk_norm", "tied"])
def test_generation_holds_under_textbook_attention(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's attention replaced by the textbook formula: the grouped-query head mapping
    # is checked against repeat_interleave, and no query row may be fully masked (that would
    # put NaN into the padded cache columns and from there into every row).
    monkeypatch.setattr(
        generate_module, "F", SimpleNamespace(scaled_dot_product_attention=_textbook_attention)
    )
    model = _model(kind)
    gen = generate(model, PROMPTS, SamplingParams(6, temperature=0.0), torch.Generator(),
                   pad_id=PAD)  # fmt: skip
    assert torch.isfinite(gen.response_logprobs).all()
    for b, prompt in enumerate(PROMPTS):
        assert gen.response[b].tolist() == _brute_force_greedy(model, prompt, 6), f"row {b}"


def test_stop_tokens_end_rows_and_pad_after() -> None:
    model = _model("gqa_qk_norm")
    steps = 10
    free = generate(model, PROMPTS, SamplingParams(steps, temperature=0.0), torch.Generator(),
                    pad_id=PAD)  # fmt: skip
    rows = free.response.tolist()
    # A stop token that some row first emits at step 3 or later and some other row never
    # emits, so the batch holds finished and unfinished rows of several lengths.
    candidates = [
        (r, i, t)
        for r, emitted in enumerate(rows)
        for i, t in enumerate(emitted)
        if i >= 2 and t not in emitted[:i] and any(t not in row for row in rows)
    ]
    assert candidates, rows
    stopping, first, stop = candidates[0]
    params = SamplingParams(steps, temperature=0.0, stop_tokens=(stop, 999))
    gen = generate(model, PROMPTS, params, torch.Generator(), pad_id=PAD)
    expected_lengths = [row.index(stop) + 1 if stop in row else steps for row in rows]
    assert gen.response_lengths.tolist() == expected_lengths
    assert gen.finished.tolist() == [stop in row for row in rows]
    assert gen.response.shape == (len(PROMPTS), max(expected_lengths))
    for b, n in enumerate(expected_lengths):
        assert gen.response[b, :n].tolist() == rows[b][:n]
        assert (gen.response[b, n:] == PAD).all()
        assert (gen.response_logprobs[b, n:] == 0.0).all()
        torch.testing.assert_close(
            gen.response_logprobs[b, :n], free.response_logprobs[b, :n], atol=LOGPROB_TOL, rtol=0
        )
    assert gen.finished[stopping]
    assert not gen.finished.all()
    assert gen.response_lengths[stopping] == first + 1


def test_every_row_stopping_ends_generation_early() -> None:
    model = _model("dense")
    free = generate(model, [[3, 4]], SamplingParams(6, temperature=0.0), torch.Generator(),
                    pad_id=PAD)  # fmt: skip
    first = int(free.response[0, 0])
    gen = generate(model, [[3, 4], [3, 4]], SamplingParams(6, temperature=0.0,
                   stop_tokens=(first,)), torch.Generator(), pad_id=PAD)  # fmt: skip
    assert gen.response.tolist() == [[first], [first]]
    assert gen.finished.all()
    assert gen.response_lengths.tolist() == [1, 1]


def test_max_new_tokens_of_one_and_the_length_limit() -> None:
    model = _model("dense")
    gen = generate(model, PROMPTS, SamplingParams(1, temperature=0.0), torch.Generator(),
                   pad_id=PAD)  # fmt: skip
    assert gen.response.shape == (len(PROMPTS), 1)
    for b, prompt in enumerate(PROMPTS):
        assert gen.response[b].tolist() == _brute_force_greedy(model, prompt, 1)
    # The longest prompt (7) plus 34 new tokens feeds positions up to 7 + 34 - 2 = 39 < 40.
    gen = generate(model, PROMPTS, SamplingParams(34, temperature=0.0), torch.Generator(),
                   pad_id=PAD)  # fmt: skip
    assert gen.response.shape == (len(PROMPTS), 34)
    assert gen.response[1].tolist() == _brute_force_greedy(model, PROMPTS[1], 34)
    with pytest.raises(ValueError, match="max_seq_len 40"):
        generate(model, PROMPTS, SamplingParams(35), torch.Generator(), pad_id=PAD)


def test_sampling_is_reproducible_and_follows_the_filters() -> None:
    model = _model("moe")
    params = SamplingParams(8, temperature=1.2, top_k=3)
    a = generate(model, PROMPTS, params, torch.Generator().manual_seed(9), pad_id=PAD)
    b = generate(model, PROMPTS, params, torch.Generator().manual_seed(9), pad_id=PAD)
    c = generate(model, PROMPTS, params, torch.Generator().manual_seed(10), pad_id=PAD)
    assert torch.equal(a.response, b.response)
    assert torch.equal(a.response_logprobs, b.response_logprobs)
    assert not torch.equal(a.response, c.response)
    # Every sampled token is among the 3 most likely of its full-forward logits.
    seqs = join(PROMPTS, a, PAD)
    with torch.no_grad():
        logits = model(seqs.tokens[:, :-1])
    top3 = logits.topk(3, dim=-1).indices
    hits = (top3 == seqs.tokens[:, 1:, None]).any(-1)
    assert hits[seqs.response_mask].all()


def test_rejected_inputs_name_the_problem() -> None:
    model = _model("dense")
    params = SamplingParams(2)
    g = torch.Generator()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], params, g, pad_id=PAD)
    with pytest.raises(ValueError, match="at least one prompt"):
        generate(model, [], params, g, pad_id=PAD)
    with pytest.raises(ValueError, match="prompt 0 has a token outside"):
        generate(model, [[VOCAB]], params, g, pad_id=PAD)
    with pytest.raises(ValueError, match="pad_id"):
        generate(model, [[1]], params, g, pad_id=-1)
    with pytest.raises(TypeError, match="Transformer"):
        generate(torch.nn.Linear(2, 2), [[1]], params, g, pad_id=PAD)
