"""The dry run's activation model against what autograd really saves, on one process.

The oracle is torch's autograd: hp-offload's ``ActivationMeter`` counts every storage autograd
saves for backward (through ``saved_tensors_hooks``) on the device and in host memory, and the
trainer's own wrappers (:func:`hp_train.parallel.activations.apply_activation_policy`) apply each
checkpointing policy and the swap. The inputs reach where the model's terms differ: grouped
key/value heads, per-head q/k norms, an MoE block with a shared expert and ``top_k < E``, bf16
next to fp32 (the norms' reciprocal RMS and the router's scores follow the compute dtype), and
tensors on both sides of the swapper's 1 KiB threshold.
"""

from __future__ import annotations

import pytest
import torch

from hp_offload.memory import ActivationMeter, Place, Token
from hp_planner.price.activation import block_activations, kept_activations
from hp_planner.price.workload import BF16_MIXED, FP32, head_activation_bytes
from hp_train.config.schema import ModelConfig, MoEConfig, TrainConfig
from hp_train.model.llama import Transformer, lm_loss
from hp_train.parallel.activations import SWAP_MIN_BYTES, apply_activation_policy

BATCH, SEQ = 4, 16
TOKENS = BATCH * SEQ
DENSE = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=SEQ)
QK_NORM = ModelConfig(
    dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=SEQ, qk_norm=True
)
MOE = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    max_seq_len=SEQ,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, every=2, n_shared_experts=1),
)
# (model, the block measured): block 1 of MOE is its MoE layer.
BLOCKS = {"dense": (DENSE, 0), "qk_norm": (QK_NORM, 0), "moe": (MOE, 1)}
DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
POLICIES = [("none", False), ("full", False), ("selective", False), ("none", True)]
POLICIES += [("selective", True)]


class _Meter(ActivationMeter):
    """Counts saved activations only: a parameter (a leaf that requires grad, or a view of one:
    a linear saves its weight transposed) is not one."""

    def hold(self, t: torch.Tensor, place: Place) -> Token | None:
        base = t._base if t._is_view() and t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return None
        return super().hold(t, place)


def _saved(
    config: ModelConfig, index: int, dtype: torch.dtype, ac: str, swap: bool
) -> tuple[int, int]:
    """Bytes block ``index`` holds for backward after its forward: on the device, in host
    memory."""
    torch.manual_seed(0)
    model = Transformer(config).to(dtype)
    block = model.layers[str(index)]
    apply_activation_policy([block], TrainConfig(ac=ac, swap=swap))
    x = torch.randn(BATCH, SEQ, config.dim, dtype=dtype, requires_grad=True)
    with _Meter(exclude=[*model.parameters(), *model.buffers()]) as meter:
        out = block(x * 1.0, model.cos[:SEQ], model.sin[:SEQ])
        held = (meter.live, meter.live_host)
    del out
    return held


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block", list(BLOCKS))
def test_kept_activations_are_the_bytes_autograd_saves(block: str, dtype: str) -> None:
    config, index = BLOCKS[block]
    torch_dtype, compute_bytes = DTYPES[dtype]
    wrong = []
    for ac, swap in POLICIES:
        acts = block_activations(
            config,
            index,
            TOKENS,
            SEQ,
            1,
            compute_bytes,
            swap_min_bytes=SWAP_MIN_BYTES if swap else None,
        )
        kept = kept_activations(acts, ac, None, swap=swap)
        predicted = (kept.on_device, kept.swapped)
        measured = _saved(config, index, torch_dtype, ac, swap)
        if predicted != measured:
            wrong.append(f"ac={ac} swap={swap}: predicted {predicted}, measured {measured}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_head_activations_are_the_bytes_autograd_saves(dtype: str) -> None:
    torch_dtype, compute_bytes = DTYPES[dtype]
    config = ModelConfig(dim=64, n_layers=1, vocab_size=320, max_seq_len=SEQ)
    model = Transformer(config).to(torch_dtype)
    assert model.norm is not None
    assert model.output is not None
    x = torch.randn(BATCH, SEQ, config.dim, dtype=torch_dtype, requires_grad=True)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with _Meter(exclude=[*model.parameters(), *model.buffers()]) as meter:
        loss = lm_loss(model.output(model.norm(x * 1.0)), targets)
        measured = meter.live
    del loss
    precision = BF16_MIXED if compute_bytes == 2 else FP32
    assert head_activation_bytes(config, TOKENS, precision) == measured
