"""Benchmark: the rollout engine's greedy generation vs Hugging Face ``generate``, same model.

A random Hugging Face ``LlamaForCausalLM`` (grouped-query attention, untied head) is saved
and loaded into hp-train's ``Transformer`` with hp-train's Hugging Face import
(``read_hf_config`` + ``load_hf_weights``), so both sides hold the same weights. The same
batch of prompts of different lengths is then generated greedily, the same number of new
tokens, by

* ``ours``: ``hp_rl.generate.generate`` (left-padded prefill of all prompts in one forward, a
  preallocated KV cache, one token per step per unfinished row);
* ``hf``: ``model.generate(..., do_sample=False, use_cache=True)`` (left-padded with an
  attention mask, no end-of-sequence token so every row runs to ``max_new_tokens``).

Both must produce the same tokens (checked, printed per size). Throughput is generated
tokens per second (``batch x max_new_tokens / time``): the median over interleaved rounds
(order rotated per round), and the fastest round. fp32, one thread (``--threads N`` for
more). This machine is shared and noisy: compare the ratios of one run. Prints a table and
one JSON line.

Run: ``nox -s bench -- rollout_vs_hf.py`` (or ``python benchmarks/rollout_vs_hf.py`` with
hp_rl, hp_train and transformers importable).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _machine import machine_info, machine_line
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from hp_rl.generate import generate
from hp_rl.sampling import SamplingParams
from hp_rl.scoring import join, sequence_logprobs
from hp_train.checkpoint.hf.hf_config import read_hf_config
from hp_train.checkpoint.hf.load import load_hf_weights
from hp_train.model.llama import Transformer

PAD = 0


@dataclass(frozen=True)
class Size:
    """One model size, its batch and how long to time it."""

    name: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    new_tokens: int
    rounds: int


SIZES = (
    Size("tiny", 64, 2, 4, 2, 176, 256, batch=8, new_tokens=32, rounds=7),
    Size("small", 256, 4, 8, 4, 704, 2048, batch=8, new_tokens=64, rounds=5),
)


def _models(size: Size) -> tuple[Transformer, LlamaForCausalLM]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.dim,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = LlamaForCausalLM(config)
    hf.train(False)
    # Random init gives near-uniform logits: widen the head so greedy picks are not near-ties
    # that rounding could flip between two correct implementations.
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = Transformer(read_hf_config(folder))
        load_hf_weights(ours, folder)
    return ours.eval(), hf


def _prompts(size: Size) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 33, (size.batch,), generator=g).tolist()
    return [torch.randint(1, size.vocab, (n,), generator=g).tolist() for n in lengths]


def _ours(model: Transformer, prompts: list[list[int]], new: int) -> torch.Tensor:
    params = SamplingParams(new, temperature=0.0)
    return generate(model, prompts, params, torch.Generator(), pad_id=PAD).response


def _logprob_gap(model: Transformer, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """Max and mean |engine logprob - full-forward logprob| over the response tokens: the
    rounding between the KV-cache computation and ``sequence_logprobs`` (what the trainer
    computes without consistency mode)."""
    gen = generate(model, prompts, SamplingParams(new, temperature=0.0), torch.Generator(),
                   pad_id=PAD)  # fmt: skip
    seqs = join(prompts, gen, PAD)
    with torch.no_grad():
        full = sequence_logprobs(model, seqs.tokens)[seqs.response_mask]
    engine = torch.cat([gen.response_logprobs[b, :new] for b in range(len(prompts))])
    gap = (engine - full).abs()
    return float(gap.max()), float(gap.mean())


def _hf(model: LlamaForCausalLM, prompts: list[list[int]], new: int) -> torch.Tensor:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            use_cache=True,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=PAD,
        )
    assert isinstance(out, torch.Tensor)
    return out[:, longest:]


def _time(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _run(size: Size) -> dict[str, Any]:
    ours_model, hf_model = _models(size)
    prompts = _prompts(size)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: _ours(ours_model, prompts, size.new_tokens),
        "hf": lambda: _hf(hf_model, prompts, size.new_tokens),
    }
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up, and the tokens to compare
    same_rows = sum(
        bool(torch.equal(a, b)) for a, b in zip(outputs["ours"], outputs["hf"], strict=True)
    )
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(size.rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            times[name].append(_time(runs[name]))
    tokens = size.batch * size.new_tokens
    gap_max, gap_mean = _logprob_gap(ours_model, prompts, size.new_tokens)
    result: dict[str, Any] = {
        "logprob_gap_max": gap_max,
        "logprob_gap_mean": gap_mean,
        "size": size.name,
        "dim": size.dim,
        "layers": size.layers,
        "batch": size.batch,
        "new_tokens": size.new_tokens,
        "prompt_lengths": [len(p) for p in prompts],
        "same_rows": same_rows,
    }
    for name, ts in times.items():
        result[f"{name}_tok_s"] = tokens / statistics.median(ts)
        result[f"{name}_best_tok_s"] = tokens / min(ts)
    result["ratio"] = result["ours_tok_s"] / result["hf_tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    print(machine_line())
    print(f"threads {args.threads}, fp32, greedy; tokens/s = batch x new tokens / time")
    results = [_run(size) for size in SIZES]
    head = f"{'size':<6} {'dim':>4} {'L':>2} {'B':>2} {'new':>4} {'ours tok/s':>12} "
    print(head + f"{'hf tok/s':>12} {'ratio':>6} {'same tokens':>12} {'logprob gap max/mean':>21}")
    for r in results:
        same = f"{r['same_rows']}/{r['batch']} rows"
        print(
            f"{r['size']:<6} {r['dim']:>4} {r['layers']:>2} {r['batch']:>2} "
            f"{r['new_tokens']:>4} {r['ours_tok_s']:>12.0f} {r['hf_tok_s']:>12.0f} "
            f"{r['ratio']:>6.2f} {same:>12} "
            f"{r['logprob_gap_max']:>10.1e}/{r['logprob_gap_mean']:.1e}"
        )
    print("ratio = ours tokens/s / hf tokens/s (> 1: the rollout engine is faster); medians")
    print(
        "logprob gap = |generate's KV-cache logprob - sequence_logprobs' full forward| over "
        "the response tokens (fp32 rounding; 0 in consistency mode)"
    )
    print(f"wall {time.perf_counter() - started:.0f} s")
    print(json.dumps({"benchmark": "rollout_vs_hf", "machine": machine_info(), "results": results}))
    mismatched = [r["size"] for r in results if r["same_rows"] != r["batch"]]
    if mismatched:
        raise SystemExit(f"ours and hf generated different tokens for sizes {mismatched}")


if __name__ == "__main__":
    main()
