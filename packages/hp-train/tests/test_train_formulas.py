"""The training loop's pure pieces against formulas and implementations written apart from
them: the learning-rate schedule (its formula here, each group's peak), gradient clipping
(``torch.nn.utils``), the loss in fp32 for bf16 logits (float64 log-sum-exp), the data order's
hash (SplitMix64's published outputs) and shuffle (every permutation as often, by
enumeration), and the held-out windows (cut by hand from the documents)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

from hp_train.config.schema import ModelConfig, RopeScaling, TrainConfig
from hp_train.data.order import is_held_out, mix64, permutation
from hp_train.data.packing import MemoryRows, eval_tokens
from hp_train.model.llama import Transformer, lm_loss, rotary_inverse_frequencies
from hp_train.observe.monitor import clip_grads_to_norm_, global_grad_norm, local_norms
from hp_train.optim import build_optimizer, build_schedule, lr_factor


def _factor(step: int, steps: int, warmup: int, floor: float) -> float:
    """Linear warm-up to the peak at step ``warmup`` (step 0 at ``1 / (warmup + 1)``), then
    half a cosine from the peak down to ``floor`` at the last step, ``steps - 1``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    last = max(steps - 1, warmup + 1)
    angle = math.pi * min(1.0, (step - warmup) / (last - warmup))
    return floor + (1 - floor) * (1 + math.cos(angle)) / 2


@pytest.mark.parametrize(("steps", "warmup", "floor"), [(12, 3, 0.1), (7, 0, 0.0), (5, 5, 0.2)])
def test_lr_schedule_is_warmup_then_cosine(steps: int, warmup: int, floor: float) -> None:
    config = TrainConfig(steps=steps, warmup_steps=warmup, min_lr_ratio=floor)
    for step in range(steps + 2):
        assert lr_factor(step, config) == pytest.approx(
            _factor(step, steps, warmup, floor), abs=1e-12
        )


def test_schedule_scales_each_groups_peak() -> None:
    config = TrainConfig(steps=9, warmup_steps=2, min_lr_ratio=0.05, lr=3e-3, muon_lr=0.02)
    optimizer = build_optimizer(Transformer(ModelConfig(n_layers=1)), config)
    schedule = build_schedule(optimizer, config)
    peaks = [g["initial_lr"] for g in optimizer.param_groups]
    assert sorted(peaks) == [3e-3, 0.02]  # AdamW's and Muon's
    for step in range(config.steps):
        expected = [peak * _factor(step, 9, 2, 0.05) for peak in peaks]
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(expected, rel=1e-12)
        optimizer.step()
        schedule.step()


def _model_with_grads(scale: float) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [1e-4, 1.0, 50.0])
def test_clipping_is_torchs(scale: float) -> None:
    """Gradients above the limit are scaled as ``torch.nn.utils.clip_grad_norm_`` scales them;
    those below stay as they are; the norm is the global one over every gradient."""
    ours, theirs = _model_with_grads(scale), _model_with_grads(scale)
    max_norm = 1.0
    norm = global_grad_norm(ours)
    reference = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert norm == pytest.approx(float(reference), rel=1e-6)
    factor = clip_grads_to_norm_(ours.parameters(), norm, max_norm)
    assert (factor < 1.0) == (float(reference) > max_norm)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    clipped = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert clipped == pytest.approx(min(float(reference), max_norm), rel=1e-5)


def test_local_norms_are_per_layer_l2_norms() -> None:
    model = _model_with_grads(1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.5 * p.grad)  # type: ignore[operator]
    norms = local_norms(model, before)
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        groups.setdefault(".".join(parts[:2]) if parts[0] == "layers" else parts[0], []).append(
            name
        )
    params = dict(model.named_parameters())
    assert set(norms) == set(groups) == {"tok_embeddings", "layers.0", "layers.1", "norm", "output"}
    for layer, names in groups.items():
        cat = torch.cat([params[n].detach().double().flatten() for n in names])
        grads = torch.cat([params[n].grad.double().flatten() for n in names])  # type: ignore[union-attr]
        update = cat - torch.cat([before[n].double().flatten() for n in names])
        assert norms[layer].param == pytest.approx(float(cat.norm()), rel=1e-5)
        assert norms[layer].grad == pytest.approx(float(grads.norm()), rel=1e-5)
        assert norms[layer].update == pytest.approx(float(update.norm()), rel=1e-5)


def test_loss_of_bf16_logits_is_computed_in_fp32() -> None:
    """Large bf16 logits: the mean cross entropy of their exact values (float64 log-sum-exp),
    to fp32 precision, not bf16's (2**-8)."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 500) * 40 + 3000).to(torch.bfloat16)
    targets = torch.randint(0, 500, (3, 7))
    exact = logits.double()
    reference = (
        (exact.logsumexp(-1) - exact.gather(-1, targets[..., None]).squeeze(-1)).mean().item()
    )
    loss = lm_loss(logits, targets)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference, rel=1e-6)


def test_rotary_frequencies_and_their_scalings() -> None:
    """``theta ** (-2i / head_dim)``; linear scaling divides each by the factor; Llama 3.1's
    keeps wavelengths below ``context / high``, divides those above ``context / low`` by the
    factor and blends linearly in ``context / wavelength`` between (a context of 64 puts
    frequencies of this 64-wide head in all three ranges)."""
    base = ModelConfig(dim=256, n_heads=4, n_kv_heads=4, rope_theta=500000.0)
    i = np.arange(0, 64, 2, dtype=np.float64)
    plain = 500000.0 ** (-i / 64)
    got = rotary_inverse_frequencies(base)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), plain, rtol=1e-6)
    linear = ModelConfig(**{**vars(base), "rope_scaling": RopeScaling("linear", 4.0)})
    np.testing.assert_allclose(
        rotary_inverse_frequencies(linear).double().numpy(), plain / 4, rtol=1e-6
    )
    llama3 = ModelConfig(**{**vars(base), "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)})
    wavelength = 2 * math.pi / plain
    expected = []
    regimes = set()
    for freq, wave in zip(plain, wavelength, strict=True):
        if wave < 64 / 4:
            expected.append(freq)
            regimes.add("kept")
        elif wave > 64 / 1:
            expected.append(freq / 8)
            regimes.add("stretched")
        else:
            blend = (64 / wave - 1) / (4 - 1)
            expected.append((1 - blend) * freq / 8 + blend * freq)
            regimes.add("blended")
    assert regimes == {"kept", "stretched", "blended"}
    np.testing.assert_allclose(
        rotary_inverse_frequencies(llama3).double().numpy(), expected, rtol=1e-6
    )


# --- the data order ---------------------------------------------------------------------------


def test_mix64_is_splitmix64() -> None:
    """One key is SplitMix64's output from that state (its published first outputs from seed
    0: states 0, one and two golden-ratio increments); more keys chain it."""
    golden = 0x9E3779B97F4A7C15
    assert mix64(0) == 0xE220A8397B1DCDAF
    assert mix64(golden) == 0x6E789E6AA1B965F4
    assert mix64(2 * golden % 2**64) == 0x06C45D188009454F
    assert mix64(0, golden) == mix64(mix64(0) ^ golden)
    assert mix64(-1) == mix64(2**64 - 1)


def test_permutations_are_drawn_uniformly() -> None:
    """Over 6,000 keys each of the 6 orders of 3 comes about 1,000 times (a shuffle that never
    leaves an element in place would give 2 of them), and over 4,000 keys each of 4 elements
    lands on each place about 1,000 times."""
    counts = Counter(tuple(permutation(3, 7, key)) for key in range(6000))
    assert set(counts) == set(itertools.permutations(range(3)))
    assert all(850 < c < 1150 for c in counts.values()), counts
    places = Counter(
        (value, place) for key in range(4000) for place, value in enumerate(permutation(4, 11, key))
    )
    assert len(places) == 16
    assert all(850 < c < 1150 for c in places.values()), places
    assert sorted(permutation(1000, 3)) == list(range(1000))


def test_held_out_share_is_the_fraction() -> None:
    rows = range(20000)
    for fraction in (0.05, 0.3):
        share = sum(is_held_out(r, 9, fraction) for r in rows) / len(rows)
        assert abs(share - fraction) < 4 * math.sqrt(fraction * (1 - fraction) / len(rows))


@pytest.mark.parametrize(("seq_len", "windows"), [(5, 3), (4, 100), (7, 1)])
def test_eval_windows_are_cut_from_the_kept_documents(seq_len: int, windows: int) -> None:
    """Kept, non-empty documents in natural order, each followed by the end of sequence; window
    ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len]`` (neighbours share one token); documents
    are read only until the windows are covered."""
    lengths = [3, 0, 6, 2, 9, 1, 4, 5, 0, 7]
    docs = [np.arange(100 * i + 1, 100 * i + 1 + n, dtype=np.int32) for i, n in enumerate(lengths)]
    keep = [i for i in range(len(docs)) if i % 3 != 1]
    eos = 99999
    got = eval_tokens(
        MemoryRows("t", docs), lambda r: r in keep, eos_id=eos, seq_len=seq_len, windows=windows
    )
    stream: list[int] = []
    read = 0
    for i in keep:
        if len(stream) >= windows * seq_len + 1:
            break
        if lengths[i]:
            stream += [*docs[i].tolist(), eos]
            read += 1
    count = min(windows, (len(stream) - 1) // seq_len)
    expected = [stream[w * seq_len : w * seq_len + seq_len + 1] for w in range(count)]
    assert got.windows.tolist() == expected
    assert (got.documents, got.tokens) == (read, len(stream))
    every = sum(1 for i in keep if lengths[i])
    assert got.complete == (read == every and len(stream) < windows * seq_len + 1)
