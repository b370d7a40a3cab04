"""The pricing's activation model against the element counts its module docstrings state.

The oracle is the docstrings of :mod:`hp_planner.price.activation` and
:mod:`hp_planner.price.workload`, restated here as formulas (per token of this rank, elements
in the compute dtype, fp32 and int64 extras in bytes), for a dense block, a block with per-head
q/k norms and an MoE block (shared expert, ``top_k < E``, a balance loss), in fp32 and bf16,
under every policy (``none``, ``full``, ``selective``, ``budget``, and the swap under ``none``
and ``selective``) and at ``tp`` 1 and 2. The cross entropy's share of the head is checked
against the tensors torch's autograd saves for it. (Whether these formulas are what hp-train's
model saves is hp-train's test, ``tests/test_dryrun_saved_tensors.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hp_planner.inputs import PlanInputError
from hp_planner.price import (
    BF16_MIXED,
    FP32,
    MoEDims,
    Precision,
    PricingError,
    TransformerDims,
    block_activations,
    kept_activations,
)
from hp_planner.price.workload import (
    block_activation_bytes,
    head_activation_bytes,
    loss_gradient_bytes,
)

BATCH, SEQ = 4, 16
TOKENS = BATCH * SEQ
SWAP_MIN = 1024  # hp-offload's Swapper threshold the trainer sets (1 KiB)

DENSE = TransformerDims(
    vocab_size=320, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96
)
QK_NORM = TransformerDims(
    vocab_size=320, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
    qk_norm=True,
)  # fmt: skip
MOE = TransformerDims(
    vocab_size=320,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=96,
    moe=MoEDims(
        n_experts=4, top_k=2, expert_ffn_dim=32, n_shared_experts=1, every=2, aux_loss_weight=0.01
    ),
)
MOE_BARE = TransformerDims(
    vocab_size=320,
    dim=64,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=96,
    moe=MoEDims(n_experts=8, top_k=2, expert_ffn_dim=32),
)
# (shape, the block priced): block 1 of MOE is its MoE layer, block 0 a dense one.
BLOCKS = {
    "dense": (DENSE, 0),
    "qk_norm": (QK_NORM, 0),
    "moe": (MOE, 1),
    "moe_dense_block": (MOE, 0),
    "moe_no_shared": (MOE_BARE, 0),
}
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class _Expected:
    """The docstrings' figures for one block and microbatch, in bytes."""

    full: int
    selective: int
    input: int
    full_small: int  # under ``none``: what a swapper leaves on the device
    selective_small: int  # under ``selective``: the same, the block's input included


def _small(tensors: list[int]) -> int:
    """The tensors a swapper of 1 KiB leaves on the device: those below it."""
    return sum(b for b in tensors if b < SWAP_MIN)


def _expected(
    s: TransformerDims,
    index: int,
    tp: int,
    cb: int,
    *,
    flash: bool = True,
    ep_tp: bool = False,
    tokens: int = TOKENS,
) -> _Expected:
    """The activation model of the module docstrings, written out."""
    d, q, kv = s.dim, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    heads = s.n_heads // tp
    moe = s.moe if s.moe is not None and s.moe.is_moe_layer(index) else None
    # none: two RMSNorms (input, normalized input, output) and one reciprocal RMS each.
    elems = 2 * 3 * d + 2
    # q, k and v expanded to every head, and the attention output.
    elems += 4 * q // tp
    # Flash attention's fp32 log-sum-exp per head, or the probabilities of every pair.
    fp32 = heads * (1 if flash else SEQ)
    # Per-token vectors (bytes each) a swapper judges by their size.
    vectors = [cb, cb, fp32 * 4]
    if s.qk_norm:
        # The q/k norms' input and normalized input, one reciprocal RMS per head.
        elems += 2 * (q + kv) // tp + (s.n_heads + s.n_kv_heads) // tp
        vectors += [heads * cb, s.n_kv_heads // tp * cb]
    int64 = 0
    per_call = 0
    # selective: the input, q/k/v, the attention output, o_proj's output (and the lse).
    sel = d + (q + 2 * kv) // tp + q // tp + d
    sel_vectors = [heads * 4]
    if moe is None:
        elems += 4 * s.ffn_dim // tp  # w1's output, its SiLU, w3's output, their product
        sel += 2 * s.ffn_dim // tp + d  # w1's and w3's outputs, w2's
    else:
        e, k = moe.n_experts, moe.top_k
        fe = moe.expert_ffn_dim // (tp if ep_tp and tp > 1 else 1)
        shared = moe.n_shared_experts * moe.expert_ffn_dim
        # Router scores; per slot its gate weight, gathered input, 4 hidden, output.
        elems += e + k * (1 + d + 4 * fe + d) + 4 * shared
        int64 = 3 * k * 8  # top-k choice, order by expert, its inverse
        per_call = e * cb if moe.aux_loss_weight > 0 else 0
        vectors += [e * cb, k * cb, k * 8, k * 8, k * 8]
        sel += e + k * (2 * fe + d) + (2 * shared + d if shared else 0)
        sel_vectors += [e * cb]
    full = tokens * (elems * cb + fp32 * 4 + int64) + per_call
    selective = tokens * (sel * cb + heads * 4)
    input_bytes = tokens * d * cb
    full_small = _small([tokens * v for v in vectors] + [per_call])
    selective_small = _small([tokens * v for v in sel_vectors]) + input_bytes
    return _Expected(full, min(full, selective), input_bytes, full_small, selective_small)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", list(COMPUTE_BYTES))
@pytest.mark.parametrize("block", list(BLOCKS))
def test_every_policy_keeps_what_the_docstring_counts(block: str, dtype: str, tp: int) -> None:
    s, index = BLOCKS[block]
    cb = COMPUTE_BYTES[dtype]
    want = _expected(s, index, tp, cb)
    acts = block_activations(s, index, TOKENS, SEQ, tp, cb)
    assert (acts.full, acts.selective, acts.input, acts.context) == (
        want.full,
        want.selective,
        want.input,
        0,
    )
    assert want.selective < want.full  # selective keeps less: min() hides nothing here
    none = kept_activations(acts, "none", None)
    assert (none.kept, none.transient, none.recompute_fraction, none.swapped) == (
        want.full,
        0,
        0.0,
        0,
    )
    full = kept_activations(acts, "full", None)
    assert (full.kept, full.transient, full.recompute_fraction) == (
        want.input,
        want.full - want.input,
        1.0,
    )
    sel = kept_activations(acts, "selective", None)
    assert (sel.kept, sel.transient, sel.recompute_fraction) == (
        want.selective,
        want.full - want.selective,
        0.0,
    )
    assert block_activation_bytes(s, index, TOKENS, SEQ, tp, Precision(compute=cb)) == want.full


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", list(COMPUTE_BYTES))
@pytest.mark.parametrize("block", list(BLOCKS))
def test_swap_leaves_the_tensors_below_its_threshold_on_the_device(
    block: str, dtype: str, tp: int
) -> None:
    s, index = BLOCKS[block]
    cb = COMPUTE_BYTES[dtype]
    want = _expected(s, index, tp, cb)
    acts = block_activations(s, index, TOKENS, SEQ, tp, cb, swap_min_bytes=SWAP_MIN)
    assert (acts.full_unswapped, acts.selective_unswapped) == (
        want.full_small,
        want.selective_small,
    )
    none = kept_activations(acts, "none", None, swap=True)
    assert (none.kept, none.on_device, none.swapped) == (
        want.full,
        want.full_small,
        want.full - want.full_small,
    )
    sel = kept_activations(acts, "selective", None, swap=True)
    assert (sel.kept, sel.on_device, sel.swapped) == (
        want.selective,
        want.selective_small,
        want.selective - want.selective_small,
    )
    # Without a threshold nothing is judged small.
    bare = block_activations(s, index, TOKENS, SEQ, tp, cb)
    assert (bare.full_unswapped, bare.selective_unswapped) == (0, 0)


def test_the_threshold_splits_the_small_tensors_by_size() -> None:
    """fp32 at 64 tokens: the norms' reciprocal RMS (256 B) stay, the log-sum-exp (1 KiB, not
    below) goes; in bf16 the q/k norms' per-head RMS (512 B) stay too."""
    fp32 = block_activations(QK_NORM, 0, TOKENS, SEQ, 1, 4, swap_min_bytes=SWAP_MIN)
    assert fp32.full_unswapped == 2 * TOKENS * 4 + TOKENS * 2 * 4
    bf16 = block_activations(QK_NORM, 0, TOKENS, SEQ, 1, 2, swap_min_bytes=SWAP_MIN)
    assert bf16.full_unswapped == 2 * TOKENS * 2 + TOKENS * (4 + 2) * 2


@pytest.mark.parametrize("block", ["dense", "qk_norm", "moe"])
def test_attention_without_flash_keeps_its_probabilities(block: str) -> None:
    s, index = BLOCKS[block]
    acts = block_activations(s, index, TOKENS, SEQ, 2, 2, flash_attention=False)
    assert acts.full == _expected(s, index, 2, 2, flash=False).full
    flash = block_activations(s, index, TOKENS, SEQ, 2, 2)
    assert acts.full - flash.full == TOKENS * s.n_heads // 2 * (SEQ - 1) * 4


def test_expert_tensor_parallelism_splits_the_routed_experts_hidden_width() -> None:
    for tp in (1, 2):
        acts = block_activations(MOE, 1, TOKENS, SEQ, tp, 2, ep_tp=True)
        want = _expected(MOE, 1, tp, 2, ep_tp=True)
        assert (acts.full, acts.selective) == (want.full, want.selective)
    whole = block_activations(MOE, 1, TOKENS, SEQ, 2, 2)
    split = block_activations(MOE, 1, TOKENS, SEQ, 2, 2, ep_tp=True)
    # 4 hidden activations per slot, half of the expert width each.
    assert whole.full - split.full == TOKENS * 2 * 4 * 16 * 2


@pytest.mark.parametrize(("variant", "cp"), [("ring", 2), ("ring", 4), ("ulysses", 2)])
def test_context_parallel_attention_keeps_its_extras(variant: str, cp: int) -> None:
    tp, cb = 2, 2
    acts = block_activations(DENSE, 0, TOKENS, SEQ, tp, cb, cp=cp, cp_variant=variant)
    q, heads = DENSE.n_heads * DENSE.head_dim, DENSE.n_heads // tp
    if variant == "ring":
        # Every visiting key/value block (fp32, 2 q wide), and each block's fp32 scores and
        # probabilities over half the sequence.
        per_token = (cp - 1) * 2 * q // tp * 4 + heads * SEQ // 2 * 2 * 4
    else:
        per_token = 4 * q // tp * cb  # gathered q/k/v and the output before the all-to-all
    want = _expected(DENSE, 0, tp, cb)
    assert acts.context == TOKENS * per_token
    assert acts.full == want.full + TOKENS * per_token
    assert acts.selective == min(acts.full, want.selective + TOKENS * per_token)


@pytest.mark.parametrize("budget_kib", [1, 16, 64, 10_000])
def test_a_budget_keeps_the_input_and_up_to_the_budget(budget_kib: int) -> None:
    budget = budget_kib * 1024
    acts = block_activations(DENSE, 0, TOKENS, SEQ, 1, 2)
    want = _expected(DENSE, 0, 1, 2)
    kept = kept_activations(acts, "budget", budget)
    assert kept.kept == min(want.full, want.input + budget)
    assert kept.transient == want.full - kept.kept
    matmul = want.selective - want.input
    assert kept.recompute_fraction == pytest.approx(max(0.0, 1 - budget / matmul))


@pytest.mark.parametrize(("ac", "budget"), [("full", None), ("budget", 1024), ("none", 1024)])
def test_swap_with_full_or_a_budget_is_refused(ac: str, budget: int | None) -> None:
    acts = block_activations(DENSE, 0, TOKENS, SEQ, 1, 2, swap_min_bytes=SWAP_MIN)
    with pytest.raises(PricingError, match="swap needs ac 'none' or 'selective'"):
        kept_activations(acts, ac, budget, swap=True)


def test_an_unknown_policy_is_refused() -> None:
    acts = block_activations(DENSE, 0, TOKENS, SEQ, 1, 2)
    with pytest.raises(PricingError, match="'sometimes'") as info:
        kept_activations(acts, "sometimes", None)
    assert isinstance(info.value, PlanInputError)


@pytest.mark.parametrize("precision", [FP32, BF16_MIXED], ids=["fp32", "bf16"])
def test_the_head_keeps_its_norm_and_the_fp32_log_softmax(precision: Precision) -> None:
    s, cb = DENSE, precision.compute
    # The final norm's input, normalized input and output, its reciprocal RMS (compute
    # dtype); the fp32 log-softmax of the logits, the int64 targets; the fp32 total weight.
    want = TOKENS * ((3 * s.dim + 1) * cb + s.vocab_size * 4 + 8) + 4
    assert head_activation_bytes(s, TOKENS, precision) == want
    assert loss_gradient_bytes(s, TOKENS) == 2 * TOKENS * s.vocab_size * 4


def _loss_saved_bytes(tokens: int, vocab: int) -> int:
    """Bytes autograd saves for the cross entropy of fp32 logits (distinct storages)."""
    logits = torch.randn(tokens, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t is not logits:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(logits * 1.0, targets)
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("precision", [FP32, BF16_MIXED], ids=["fp32", "bf16"])
def test_the_heads_loss_share_is_what_torchs_cross_entropy_saves(precision: Precision) -> None:
    """The head's bytes less its norm's (``(3 dim + 1)`` compute-dtype values per token) are
    what autograd keeps for ``F.cross_entropy`` of the fp32 logits, whatever the compute
    dtype."""
    s = DENSE
    norm = TOKENS * (3 * s.dim + 1) * precision.compute
    loss = head_activation_bytes(s, TOKENS, precision) - norm
    assert loss == _loss_saved_bytes(TOKENS, s.vocab_size)
