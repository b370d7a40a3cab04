"""Tests for hp_train.observe.flops and .peak_flops: the FLOPs per token against torch's own
FLOP counter on the real model, MFU's formula, and the peak estimates from machine facts."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hp_train.config.schema import ModelConfig, MoEConfig
from hp_train.model.llama import Transformer, lm_loss
from hp_train.observe.flops import forward_flops_per_token, mfu, training_flops_per_token
from hp_train.observe.peak_flops import (
    cpu_flags,
    cpu_peak,
    cuda_peak,
    flops_per_cycle,
    max_clock_hz,
    peak_flops,
)

DENSE = ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16
)
MOE = ModelConfig(
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    max_seq_len=16,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24, every=2, n_shared_experts=1),
)


def counted_flops_per_token(config: ModelConfig, batch: int, seq: int) -> float:
    """torch's FlopCounterMode over one forward and backward of the real model, per token.

    Attention runs on SDPA's math backend: its matmuls are then ordinary bmm the counter
    sees (the fused CPU kernel has no FLOP formula registered and would count as 0)."""
    torch.manual_seed(0)
    model = Transformer(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        lm_loss(model(ids), ids).backward()
    return float(counter.get_total_flops()) / (batch * seq)


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("seq", [8, 16])
def test_training_flops_per_token_are_what_torch_counts(config: ModelConfig, seq: int) -> None:
    """Exact: every matmul the formula counts is one the model runs, at the same size (MoE:
    each token's top-k rows go through their experts whatever the routing, so the routed
    total is top_k x tokens)."""
    assert training_flops_per_token(config, seq) == counted_flops_per_token(config, 2, seq)


def test_the_forward_of_a_dense_model_by_hand() -> None:
    # DENSE: head_dim 8, q 32 wide, k/v 16 wide each; per block: projections
    # 2*32*(32+16+16) + 2*32*32, attention 4*seq*32, SwiGLU 6*32*48; head 2*32*64.
    seq = 8
    block = 2 * 32 * 64 + 2 * 32 * 32 + 4 * seq * 32 + 6 * 32 * 48
    assert forward_flops_per_token(DENSE, seq) == 2 * block + 2 * 32 * 64
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops_per_token(DENSE, 0)


def test_mfu_is_achieved_flops_per_rank_over_the_peak() -> None:
    # 1e6 FLOPs/token x 4096 tokens in 0.5 s over 4 ranks = 2.048e9 FLOP/s per rank.
    assert mfu(10**6, 4096, 0.5, 4, 1e10) == pytest.approx(0.2048)
    assert mfu(10**6, 4096, 0.5, 4, None) is None
    assert mfu(10**6, 4096, 0.0, 4, 1e10) is None
    with pytest.raises(ValueError, match="peak"):
        mfu(10**6, 4096, 0.5, 4, 0.0)


CPUINFO = """processor\t: 0
model name\t: Some CPU
cpu MHz\t\t: 2596.138
flags\t\t: fpu sse2 avx fma avx2 avx512f
processor\t: 1
cpu MHz\t\t: 2400.000
flags\t\t: fpu sse2 avx fma avx2 avx512f
"""


def test_the_cpu_peak_is_threads_times_clock_times_flops_per_cycle() -> None:
    assert {"avx512f", "fma", "sse2"} <= cpu_flags(CPUINFO)
    assert flops_per_cycle(cpu_flags(CPUINFO)) == (64, "avx512f")
    assert flops_per_cycle(frozenset({"sse2", "avx", "fma"})) == (32, "fma")
    assert flops_per_cycle(frozenset({"mmx"})) is None
    # cpufreq's maximum wins over the current clocks; without it, the largest cpu MHz.
    assert max_clock_hz(CPUINFO, "3500000\n") == 3.5e9
    assert max_clock_hz(CPUINFO, None) == pytest.approx(2596.138e6)
    peak = cpu_peak(CPUINFO, None, threads=2)
    assert peak.flops == pytest.approx(2 * 2596.138e6 * 64)
    assert "2 thread(s)" in peak.how
    assert "avx512f" in peak.how
    assert cpu_peak("processor: 0\n", None, 1).flops is None


def test_the_given_peak_wins_and_unknown_devices_have_none() -> None:
    given = peak_flops(torch.device("cpu"), "fp32", 12.5)
    assert given.flops == 12.5e12
    assert "--peak-tflops 12.5" in given.how
    assert cuda_peak("NVIDIA H100 80GB HBM3", "bf16").flops == 989e12
    assert cuda_peak("NVIDIA H100 PCIe", "fp32").flops == 51e12
    assert cuda_peak("Some Future GPU", "bf16").flops is None
    assert peak_flops(torch.device("meta"), "fp32", None).flops is None
    with pytest.raises(ValueError, match="positive"):
        peak_flops(torch.device("cpu"), "fp32", -1.0)
