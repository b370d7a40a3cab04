"""``hp_rl.scoring``: ``sequence_logprobs`` against a hand loop over prefixes, with autograd;
``join``'s tokens and response mask against hand-written layouts."""

from __future__ import annotations

import math

import pytest
import torch

from hp_rl.generate import Generation
from hp_rl.scoring import join, sequence_logprobs
from hp_train.config.schema import ModelConfig
from hp_train.model.llama import Transformer

CONFIG = ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                     max_seq_len=16)  # fmt: skip


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sequence_logprobs_equal_a_hand_loop_over_prefixes(temperature: float) -> None:
    torch.manual_seed(0)
    model = Transformer(CONFIG).eval()
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = sequence_logprobs(model, tokens, temperature)
        assert got.shape == (3, 8)
        assert got.dtype == torch.float32
        for b in range(3):
            for j in range(8):
                # Position j alone: the prefix up to it, its last logits, a float64 softmax.
                row = model(tokens[b : b + 1, : j + 1])[0, -1].double().tolist()
                scaled = [x / temperature for x in row]
                peak = max(scaled)
                log_total = peak + math.log(sum(math.exp(x - peak) for x in scaled))
                want = scaled[int(tokens[b, j + 1])] - log_total
                assert got[b, j].item() == pytest.approx(want, abs=1e-5), (b, j)


def test_sequence_logprobs_carry_gradients_when_enabled() -> None:
    torch.manual_seed(0)
    model = Transformer(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 6))
    out = sequence_logprobs(model, tokens)
    out.sum().backward()
    assert model.tok_embeddings is not None
    grad = model.tok_embeddings.weight.grad
    assert grad is not None
    assert grad.abs().sum() > 0
    with torch.no_grad():
        assert not sequence_logprobs(model, tokens).requires_grad


def test_sequence_logprobs_reject_bad_arguments() -> None:
    model = Transformer(CONFIG)
    with pytest.raises(ValueError, match="T >= 2"):
        sequence_logprobs(model, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        sequence_logprobs(model, torch.zeros(2, 3, dtype=torch.int64), 0.0)


def _generation(responses: list[list[int]], prompts: list[list[int]], pad: int) -> Generation:
    width = max(len(r) for r in responses)
    response = torch.full((len(responses), width), pad, dtype=torch.int64)
    for b, r in enumerate(responses):
        response[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return Generation(
        prompt_lengths=torch.tensor([len(p) for p in prompts]),
        response=response,
        response_logprobs=torch.zeros(response.shape),
        response_lengths=torch.tensor([len(r) for r in responses]),
        finished=torch.zeros(len(responses), dtype=torch.bool),
    )


def test_join_lays_out_prompt_then_response_with_the_predicted_positions_masked() -> None:
    prompts = [[5, 6], [7, 8, 9, 10], [11]]
    responses = [[1, 2, 3], [4], [12, 13]]
    seqs = join(prompts, _generation(responses, prompts, pad=0), pad_id=0)
    assert seqs.tokens.tolist() == [
        [5, 6, 1, 2, 3],
        [7, 8, 9, 10, 4],
        [11, 12, 13, 0, 0],
    ]
    # Position j predicts tokens[j + 1]; True where that is a response token.
    assert seqs.response_mask.tolist() == [
        [False, True, True, True],
        [False, False, False, True],
        [True, True, False, False],
    ]


def test_join_refuses_prompts_of_another_generation() -> None:
    prompts = [[5, 6], [7]]
    gen = _generation([[1], [2]], prompts, pad=0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        join([[5, 6], [7, 8]], gen, pad_id=0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        join([[5, 6]], gen, pad_id=0)
