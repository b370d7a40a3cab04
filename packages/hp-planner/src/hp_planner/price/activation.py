"""What a block keeps for its backward under each activation-checkpointing policy
(``TrainConfig.ac``, applied by :func:`hp_train.parallel.activations.apply_activation_policy`).

Per token of this rank (a context-parallel rank holds ``1 / cp`` of each sequence), with
``q`` the query width and ``kv`` the key/value width, ``fe`` an expert's hidden width (over
``tp`` with expert-tensor parallelism), widths divided by ``tp`` where the plan splits them:

* **none**: everything autograd keeps (:func:`block_activations`' ``full``: the norms' inputs
  and outputs, q/k/v, the attention output, the feed-forward's hidden activations, an MoE's
  routed copies; see :mod:`~hp_planner.price.workload`);
* **full** (``FULL_RECOMPUTE``): only the block's input (``dim``); in backward one block's
  ``full`` activations exist again while it is recomputed, and its forward runs again;
* **selective** (``SELECTIVE``: matmul and attention outputs saved): the input, q/k/v
  (``q + 2 kv``), the attention output (plus its fp32 log-sum-exp), ``o_proj``'s output
  (``dim``), a dense SwiGLU's ``w1``/``w3`` outputs (``2 ffn``) and ``w2``'s (``dim``), an MoE's
  router scores (``E``) and per routed slot ``2 fe + dim``, shared experts like a dense
  SwiGLU; the pointwise and normalization ops are recomputed (their FLOPs are not counted);
* **budget:<MiB>** (``BudgetPolicy``: the outputs worth most recompute per byte first, up to
  the budget per block call, i.e. per microbatch): ``min(full, input + budget)`` kept; the
  matmul outputs it cannot keep are recomputed, ``1 - budget / selective`` of the block's
  forward FLOPs when the budget is below the selective set, none above it. An estimate: the
  policy fills the budget greedily op by op (a small budget keeps up to a few percent less),
  and a budget above what the block's costed ops output saves every one of those outputs,
  pointwise ones included, which is more than ``full`` (a 1 MiB budget on a 64-wide block
  of 32 tokens keeps 1.7 times ``full``); the model caps it at ``full``.

Context parallelism adds what its attention keeps (:mod:`hp_dtensor.parallel
.context_attention`): ring attention keeps every visiting key/value block (fp32, ``cp - 1`` of
them, ``2 q`` per token each) and each block's fp32 scores and probabilities (``2 x heads x
seq / 2`` per token: with the zigzag split every rank attends to half the sequence); Ulysses
keeps the gathered q/k/v and the attention output before the reverse all-to-all (``4 q``).
Those are attention outputs, so ``selective`` keeps them too; ``full`` and ``budget`` rebuild
them only for the block being recomputed.

Swap (``TrainConfig.swap``, hp-offload's ``Swapper`` under ``none`` or ``selective``): what a
block keeps goes to host memory, except its tensors below the swapper's ``min_bytes``
(``hp_train.parallel.activations.SWAP_MIN_BYTES``): of those only the per-token vectors (the norms'
reciprocal RMS in the compute dtype, the attention's fp32 log-sum-exp, the router's fp32
scores) can be that small, each a ``tokens x width`` tensor; the rest are at least
``tokens x dim`` wide. Under
``selective`` the block's input stays on the device too (the checkpoint saves it, not the
swapper).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hp_planner.price.model import PricingError, TransformerShape

__all__ = ["BlockActivations", "KeptActivations", "block_activations", "kept_activations"]


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for one microbatch on one rank, by what the policies keep.

    Attributes:
        full: everything autograd keeps without checkpointing (context-parallel extras
            included).
        selective: the block's input and its matmul and attention outputs (extras included).
        input: the block's input.
        context: the context-parallel attention's extras (part of ``full`` and ``selective``).
        full_unswapped: the part of ``full`` a swapper leaves on the device (tensors below
            its ``min_bytes``; 0 when no threshold was given).
        selective_unswapped: the same of ``selective``, the block's input included.
    """

    full: int
    selective: int
    input: int
    context: int
    full_unswapped: int = 0
    selective_unswapped: int = 0


@dataclass(frozen=True)
class KeptActivations:
    """What a block keeps under a policy.

    Attributes:
        kept: bytes kept from its forward to its backward, per microbatch (on the device,
            or in host memory where swapped).
        transient: bytes rebuilt while it is recomputed in backward (one block at a time).
        recompute_fraction: share of its forward FLOPs run again in backward.
        swapped: the part of ``kept`` held in host memory (0 without swap).
    """

    kept: int
    transient: int
    recompute_fraction: float
    swapped: int = 0

    @property
    def on_device(self) -> int:
        """The part of ``kept`` the device holds from forward to backward."""
        return self.kept - self.swapped


def _q(model: TransformerShape) -> int:
    return model.n_heads * model.head_dim


def _kv(model: TransformerShape) -> int:
    return model.n_kv_heads * model.head_dim


@dataclass(frozen=True)
class _FeedForward:
    """What a block's feed-forward keeps, per token of this rank.

    Attributes:
        full: elements autograd keeps, in the compute dtype.
        selective: elements ``selective`` keeps, in the compute dtype.
        indices: bytes of the routing's int64 indices (0 for a dense block).
        per_call: bytes kept once per call whatever the tokens (the balance loss's).
        full_vectors: bytes per token of each of its small per-token tensors under ``none``
            (each one tensor the swapper judges by its size).
        selective_vectors: the same under ``selective``.
    """

    full: float
    selective: float
    indices: float = 0.0
    per_call: int = 0
    full_vectors: tuple[float, ...] = ()
    selective_vectors: tuple[float, ...] = ()


def _feed_forward(
    model: TransformerShape, index: int, tp: int, compute_bytes: int, ep_tp: bool
) -> _FeedForward:
    """What block ``index``'s feed-forward keeps (module doc): a dense SwiGLU's hidden
    activations (``selective``: ``w1``/``w3``'s and ``w2``'s outputs), or an MoE layer's."""
    d, moe = model.dim, model.moe
    if moe is None or not moe.is_moe_layer(index):
        return _FeedForward(full=4 * model.ffn_dim / tp, selective=2 * model.ffn_dim / tp + d)
    fe = moe.expert_ffn_dim / (tp if ep_tp and tp > 1 else 1)
    shared = moe.n_shared_experts * moe.expert_ffn_dim
    k, experts = moe.top_k, moe.n_experts
    # Router scores, and per routed slot its gate weight, gathered input, expert
    # activations and output.
    ffn = experts + k * (2 * d + 4 * fe + 1) + 4 * shared
    sel = experts + k * (2 * fe + d) + (2 * shared + d if shared else 0)
    # The routing's int64 indices, one per slot each: the top-k choice, the order of the
    # slots by expert and its inverse.
    indices = 3 * k * 8
    # The balance loss keeps each expert's share of the routed slots (once per call).
    per_call = experts * compute_bytes if moe.aux_loss_weight > 0 else 0
    return _FeedForward(
        full=ffn,
        selective=sel,
        indices=indices,
        per_call=per_call,
        full_vectors=(experts * compute_bytes, k * compute_bytes, k * 8, k * 8, k * 8),
        selective_vectors=(experts * compute_bytes,),
    )


def _context(
    model: TransformerShape, seq_len: int, tp: int, compute_bytes: int, cp: int, cp_variant: str
) -> float:
    """Bytes per token of this rank the context-parallel attention keeps (module doc)."""
    q, heads = _q(model), model.n_heads / tp
    if cp > 1 and cp_variant == "ring":
        return (cp - 1) * 2 * q / tp * 4 + heads * seq_len / 2 * 2 * 4
    if cp > 1:
        return 4 * q / tp * compute_bytes
    return 0.0


def _unswapped(
    tokens: int,
    full_vectors: list[float],
    selective_vectors: list[float],
    per_call: int,
    input_bytes: int,
    swap_min_bytes: int,
) -> tuple[int, int]:
    """The bytes a swapper of threshold ``swap_min_bytes`` leaves on the device under
    ``none`` and under ``selective`` (which keeps the block's ``input_bytes`` there too):
    the tensors below the threshold."""
    small = [int(tokens * w) for w in full_vectors]
    full_unswapped = sum(b for b in [*small, per_call] if b < swap_min_bytes)
    small = [int(tokens * w) for w in selective_vectors]
    selective_unswapped = sum(b for b in small if b < swap_min_bytes)
    selective_unswapped += input_bytes
    return full_unswapped, selective_unswapped


def block_activations(
    model: TransformerShape,
    index: int,
    tokens: int,
    seq_len: int,
    tp: int,
    compute_bytes: int,
    *,
    flash_attention: bool = True,
    cp: int = 1,
    cp_variant: str = "ring",
    ep_tp: bool = False,
    swap_min_bytes: int | None = None,
) -> BlockActivations:
    """The activations of block ``index`` for ``tokens`` tokens of this rank (module doc);
    with ``swap_min_bytes``, what a swapper of that threshold leaves on the device."""
    d, q, kv = model.dim, _q(model), _kv(model)
    heads = model.n_heads / tp
    scores = heads * (1 if flash_attention else seq_len)
    # q, the keys and values repeated to every query head, and the output (shared with
    # o_proj's input): four query widths whatever n_kv_heads is. Per-head q/k norms add their
    # input and normalized input; their output takes the projection's place as the rotary's
    # input.
    attn = 4 * q / tp + (2 * (q + kv) / tp if model.qk_norm else 0.0)
    # Reciprocal RMS per token, in the compute dtype (RMSNorm computes in its input's): the
    # two block norms' and, with q/k norms, one per query and key head.
    rms = [1.0, 1.0] + ([heads, model.n_kv_heads / tp] if model.qk_norm else [])
    ff = _feed_forward(model, index, tp, compute_bytes, ep_tp)
    sel = (q + 2 * kv) / tp + q / tp + d
    sel += ff.selective
    sel_fp32 = heads
    fp32 = scores
    context = _context(model, seq_len, tp, compute_bytes, cp, cp_variant)
    full = (
        tokens
        * ((6 * d + attn + ff.full + sum(rms)) * compute_bytes + fp32 * 4 + ff.indices + context)
        + ff.per_call
    )
    selective = tokens * ((sel + d) * compute_bytes + sel_fp32 * 4 + context)
    input_bytes = int(tokens * d * compute_bytes)
    full_unswapped = selective_unswapped = 0
    if swap_min_bytes is not None:
        # The small per-token tensors, in bytes per token.
        full_vectors = [w * compute_bytes for w in rms] + [scores * 4, *ff.full_vectors]
        selective_vectors = [heads * 4, *ff.selective_vectors]
        full_unswapped, selective_unswapped = _unswapped(
            tokens, full_vectors, selective_vectors, ff.per_call, input_bytes, swap_min_bytes
        )
    return BlockActivations(
        full=int(full),
        selective=int(min(full, selective)),
        input=input_bytes,
        context=int(tokens * context),
        full_unswapped=full_unswapped,
        selective_unswapped=selective_unswapped,
    )


def kept_activations(
    acts: BlockActivations, ac: str, budget: int | None, *, swap: bool = False
) -> KeptActivations:
    """What a block keeps under policy ``ac`` (``budget``: the bytes of ``budget:<MiB>``), with
    ``swap`` what of it goes to host memory (``acts`` computed with the swapper's threshold).

    Postcondition: ``0 <= swapped <= kept``; ``swapped == 0`` without ``swap``.

    Raises:
        PricingError: an unknown policy, or ``swap`` with ``full`` or a budget (the trainer
            refuses both pairs: nothing to swap, or the budget decides what stays).
    """
    if swap:
        if budget is not None or ac not in ("none", "selective"):
            raise PricingError(
                f"swap needs ac 'none' or 'selective', got {ac!r} (the trainer refuses --swap "
                "with --ac full and --ac budget:<MiB>)"
            )
        whole = kept_activations(acts, ac, None)
        small = acts.full_unswapped if ac == "none" else acts.selective_unswapped
        return replace(whole, swapped=whole.kept - min(small, whole.kept))
    if budget is not None:
        kept = min(acts.full, acts.input + budget)
        matmul = max(1, acts.selective - acts.input)
        fraction = max(0.0, 1.0 - budget / matmul)
        return KeptActivations(kept, acts.full - kept, fraction)
    if ac == "none":
        return KeptActivations(acts.full, 0, 0.0)
    if ac == "full":
        return KeptActivations(acts.input, acts.full - acts.input, 1.0)
    if ac == "selective":
        return KeptActivations(acts.selective, acts.full - acts.selective, 0.0)
    raise PricingError(f"ac must be none, full, selective or budget:<MiB>, got {ac!r}")
