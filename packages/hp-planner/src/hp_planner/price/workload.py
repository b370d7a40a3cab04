"""What one training step asks of a rank: its shape (batch, precision, schedule options) and
the per-layer FLOPs and saved activations of the model.

FLOPs model (forward, per token, per rank; a multiply-add is 2 FLOPs; backward is twice the
forward; recomputation adds one more forward of the blocks):

* attention projections ``2 * (2 * dim * q_dim + 2 * dim * kv_dim) / tp`` (``q_dim`` is
  ``n_heads * head_dim``, ``dim`` unless the head width is explicit); scores and weighted
  values ``2 * seq * q_dim / tp`` (``4 * seq * q_dim`` for all pairs, halved by the causal
  mask);
* dense SwiGLU ``6 * dim * ffn / tp``; MoE: router ``2 * dim * E``, ``top_k`` routed experts
  and the shared ones, ``6 * dim * expert_ffn`` each, not divided by ``tp``: the trainer's plan
  keeps MoE feed-forwards whole, so every tensor-parallel rank computes them for all tokens;
* output head ``2 * dim * vocab / tp``; the embedding lookup is free.

Activation model (elements saved for backward per token; the tensors autograd keeps for this
model's modules, with flash attention keeping no ``seq x seq`` scores):

* each RMSNorm: its input, the normalized input and its output: ``3 * dim`` (two per block),
  and one reciprocal RMS (in the compute dtype, as RMSNorm computes in its input's);
* attention: q, k and v (expanded to all heads) and the attention output (its storage is the
  o_proj input too): ``4 * q_dim / tp``, plus ``n_heads / tp`` log-sum-exp values (with
  ``flash_attention=False``, the ``n_heads / tp * seq`` attention probabilities instead);
  per-head q/k norms (``qk_norm``): their input and normalized input ``2 * (q_dim + kv_dim) /
  tp`` (their output is the rotary's input in place of the projection's) and one reciprocal RMS
  per head, ``(n_heads + n_kv_heads) / tp``;
* dense SwiGLU: w1's output, its SiLU, w3's output and their product: ``4 * ffn / tp``;
* MoE (whole on every tensor-parallel rank, as the trainer keeps it): router scores ``E``
  and, per routed slot (``top_k`` per token), its gate weight, the gathered input ``dim``,
  ``4 * expert_ffn`` and the expert output ``dim``, and three int64 routing indices (24
  bytes); shared experts like a dense SwiGLU of width ``n_shared * expert_ffn``, not divided
  by ``tp`` either; the balance loss keeps ``E`` values once per call;
* head: final norm ``3 * dim`` (and its reciprocal RMS), the log-softmax of the logits,
  ``vocab`` in fp32 (the loss's gathered logits are whole on every tensor-parallel rank), and
  the loss's int64 targets; the first step of backward then holds two more fp32 vocabulary
  rows per token (the gradients of the log-softmax and of the logits,
  :func:`loss_gradient_bytes`).

Checked against the tensors autograd saves for hp-train's blocks and head on one process
(exact, fp32 and bf16, dense, q/k-norm and MoE blocks, every policy but budgets:
hp-train's ``tests/test_dryrun_saved_tensors.py``), and the resulting peak against a measured
step (hp-train's ``tests/test_dryrun_vs_measured.py``); the formulas themselves by hp-planner's
``tests/test_price_activation.py``.

With ``recompute`` each block keeps only its input (``dim`` per token); one block's full
activations exist again while it is recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hp_planner.inputs import PlanInputError
from hp_planner.price.activation import block_activations
from hp_planner.price.model import PricingError, TransformerShape
from hp_planner.recipe import FP8_RECIPES, OFFLOAD_TARGETS, SCHEDULES, ac_budget_bytes

__all__ = [
    "BF16_MIXED",
    "FP32",
    "RUNTIMES",
    "Precision",
    "StepShape",
    "attention_forward_flops",
    "block_activation_bytes",
    "block_forward_flops",
    "head_activation_bytes",
    "head_forward_flops",
    "loss_gradient_bytes",
    "precision_of",
]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of data.

    Attributes:
        param: sharded parameters (FSDP's storage, the master weights).
        compute: unsharded parameters (the all-gather), activations and unsharded gradients
            (FSDP's ``param_dtype``).
        reduce: gradient reduction (reduce-scatter input, HSDP all-reduce) and the sharded
            gradients (FSDP's ``reduce_dtype``).
        optimizer: optimizer state (Muon momentum, AdamW moments).
    """

    param: int = 4
    compute: int = 4
    reduce: int = 4
    optimizer: int = 4

    def __post_init__(self) -> None:
        for name in ("param", "compute", "reduce", "optimizer"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise PricingError(f"precision.{name} must be 1, 2, 4 or 8 bytes")


FP32 = Precision()
"""Everything in fp32 (the CPU runs)."""

BF16_MIXED = Precision(param=4, compute=2, reduce=4, optimizer=4)
"""fp32 master weights, optimizer state and gradient reduction; bf16 compute and all-gather."""


def precision_of(mixed_precision: str, grad_reduce_dtype: str = "fp32") -> Precision:
    """The element sizes of the trainer's ``mixed_precision`` (``"fp32"`` or ``"bf16"``) with
    its gradient reduction in ``grad_reduce_dtype`` (``"fp32"`` or ``"bf16"``).

    Raises:
        PricingError: a value the trainer does not take.
    """
    for name, value in (
        ("mixed_precision", mixed_precision),
        ("grad_reduce_dtype", grad_reduce_dtype),
    ):
        if value not in ("fp32", "bf16"):
            raise PricingError(f"{name} must be 'fp32' or 'bf16', got {value!r}")
    base = BF16_MIXED if mixed_precision == "bf16" else FP32
    return replace(base, reduce=2) if grad_reduce_dtype == "bf16" else base


RUNTIMES = ("hp", "torch_fsdp2", "megatron_ddp")
"""Data-parallel runtimes the dry run models:

* ``"hp"``: hp-fsdp as hp-train runs it (flat buffers the collectives read and write in
  place; the replicas' all-reduce on its own tier, once per step, pipelined behind the
  backward);
* ``"torch_fsdp2"``: PyTorch's ``fully_shard``: the same groups, plus a copy-in before and a
  copy-out after every all-gather and reduce-scatter (``2 x (chunk + padded)`` elements read
  and written at device memory bandwidth, on the compute stream: exposed), and under HSDP one
  all-reduce per group and microbatch queued behind its reduce-scatter on the one FSDP stream
  (no cross-layer pipeline across the tiers);
* ``"megatron_ddp"``: Megatron's DDP: parameters, gradients and optimizer state replicated
  over the data-parallel ranks (within the tensor-, expert- and pipeline-parallel split), one
  gradient all-reduce per block over all data-parallel ranks (the experts' over the ranks
  holding the same ones), across the tiers, once per step, overlapped with the last
  microbatch's backward; no all-gathers.
"""


@dataclass(frozen=True)
class StepShape:
    """The shape and options of one optimizer step.

    Attributes:
        global_batch: sequences per step over all data-parallel ranks.
        seq_len: tokens per sequence.
        microbatches: sequential microbatches per data-parallel rank (gradient accumulation,
            the trainer's ``grad_accum``; pipeline microbatches with ``pp > 1``); each runs
            FSDP's gathers and reductions.
        pipeline_steps: with ``pp > 1``, the pipeline schedules (each of ``microbatches``)
            one optimizer step runs one after the other (the trainer's ``grad_accum`` under
            pipelining); 1 otherwise. The step computes :attr:`passes` microbatches and has
            this many fills and drains of the pipeline.
        ac: activation checkpointing of every block, as ``TrainConfig.ac`` names it:
            ``"none"``, ``"full"``, ``"selective"`` or ``"budget:<MiB>"``
            (:mod:`~hp_planner.price.activation`).
        optimizer: ``"muon"`` (Muon on matrices, AdamW on the rest) or ``"adamw"``.
        precision: bytes per element.
        prefetch: FSDP prefetches the next group (accelerators: yes; hp_fsdp on CPU: no).
        flash_attention: attention keeps no ``seq x seq`` scores.
        muon_bucket_mb: ``hp_muon.Muon``'s ``bucket_cap_mb`` (bf16 MiB per exchange).
        offload: ``TrainConfig.offload``: ``"none"``, ``"optimizer"``, ``"params"``, ``"both"``.
        fp8: ``TrainConfig.fp8``: ``"none"``, ``"tensorwise"`` or ``"blockwise"`` FP8 linears.
        fp8_all_gather: FSDP all-gathers e4m3 with one fp32 scale per 128 elements.
        expert_imbalance: rows an expert-parallel rank receives over the rows it sends
            (``top_k`` per token), for the rank the figures are for: 1 for a perfectly
            balanced router; the most loaded rank's ratio bounds the step.
        pp_schedule: ``"1f1b"``, ``"gpipe"``, ``"zbh1"``, ``"interleaved"`` or
            ``"dualpipev"`` (``hp_train.parallel.pipeline.PIPELINE_SCHEDULES``).
        runtime: the data-parallel runtime modeled (:data:`RUNTIMES`): ``"hp"`` (hp-fsdp,
            what hp-train runs), ``"torch_fsdp2"`` or ``"megatron_ddp"`` (the baselines of
            :mod:`~hp_planner.price.reproduce`).
        swap: ``TrainConfig.swap``: the blocks' kept activations live in host memory between
            their forward and backward (with ``ac`` ``"none"`` or ``"selective"``).
    """

    global_batch: int
    seq_len: int
    microbatches: int = 1
    pipeline_steps: int = 1
    ac: str = "none"
    optimizer: str = "muon"
    precision: Precision = BF16_MIXED
    prefetch: bool = True
    flash_attention: bool = True
    muon_bucket_mb: float = 32.0
    offload: str = "none"
    fp8: str = "none"
    fp8_all_gather: bool = False
    expert_imbalance: float = 1.0
    pp_schedule: str = "1f1b"
    runtime: str = "hp"
    swap: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len", "microbatches", "pipeline_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PricingError(f"{name} must be a positive integer, got {value!r}")
        if self.optimizer not in ("muon", "adamw"):
            raise PricingError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if not self.muon_bucket_mb > 0:
            raise PricingError(f"muon_bucket_mb must be > 0, got {self.muon_bucket_mb}")
        for name, allowed in (
            ("offload", OFFLOAD_TARGETS),
            ("fp8", FP8_RECIPES),
            ("pp_schedule", SCHEDULES),
            ("runtime", RUNTIMES),
        ):
            if getattr(self, name) not in allowed:
                raise PricingError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 < self.expert_imbalance < float("inf"):
            raise PricingError(
                f"expert_imbalance must be a finite number > 0 (1: balanced), got "
                f"{self.expert_imbalance!r}"
            )
        self.ac_budget_bytes  # noqa: B018 - parses ``ac``
        if not isinstance(self.swap, bool):
            raise PricingError(f"swap must be True or False, got {self.swap!r}")

    @property
    def recompute(self) -> bool:
        """Whether every block's forward runs again in backward (``ac="full"``)."""
        return self.ac == "full"

    @property
    def ac_budget_bytes(self) -> int | None:
        """The per-block budget of ``ac="budget:<MiB>"`` in bytes (None for other modes).

        Raises:
            PricingError: ``ac`` is none of the trainer's modes (its message).
        """
        try:
            return ac_budget_bytes(self.ac)
        except PlanInputError as exc:
            raise PricingError(str(exc)) from None

    def microbatch_size(self, dp: int) -> int:
        """Sequences per microbatch on one data-parallel rank.

        Raises:
            PricingError: the global batch does not split evenly over ``dp`` ranks and the
                microbatches.
        """
        if self.global_batch % dp:
            raise PricingError(
                f"global_batch={self.global_batch} is not divisible by the data-parallel degree "
                f"dp_replicate x dp_shard = {dp}"
            )
        local = self.global_batch // dp
        if local % self.passes:
            raise PricingError(
                f"the {local} sequences per data-parallel rank do not split into "
                f"microbatches={self.microbatches} x pipeline_steps={self.pipeline_steps}; "
                f"choose a divisor of {local}"
            )
        return local // self.passes

    @property
    def passes(self) -> int:
        """The microbatches one optimizer step computes per data-parallel rank
        (``microbatches x pipeline_steps``)."""
        return self.microbatches * self.pipeline_steps


def _kv_dim(model: TransformerShape) -> int:
    return model.n_kv_heads * model.head_dim


def _q_dim(model: TransformerShape) -> int:
    return model.n_heads * model.head_dim


def block_forward_flops(
    model: TransformerShape,
    index: int,
    tp: int,
    seq_len: int,
    *,
    ep_tp: bool = False,
    expert_imbalance: float = 1.0,
) -> float:
    """Forward FLOPs per token of block ``index`` on one of ``tp`` tensor-parallel ranks.

    ``ep_tp``: the routed experts' hidden dims are split over ``tp`` (``--ep-tp``);
    ``expert_imbalance``: this rank's routed-expert rows over the balanced share (expert
    parallelism: a rank computes the rows its experts receive)."""
    d = model.dim
    attn = attention_forward_flops(model, tp, seq_len)
    moe = model.moe
    if moe is not None and moe.is_moe_layer(index):
        split = tp if ep_tp else 1
        routed = moe.top_k * 6 * d * moe.expert_ffn_dim / split * expert_imbalance
        shared = moe.n_shared_experts * 6 * d * moe.expert_ffn_dim
        ffn: float = 2 * d * moe.n_experts + routed + shared
    else:
        ffn = 6 * d * model.ffn_dim / tp
    return attn + ffn


def attention_forward_flops(model: TransformerShape, tp: int, seq_len: int) -> float:
    """Forward FLOPs per token of a block's attention (projections and scores) on one of
    ``tp`` ranks: the part of :func:`block_forward_flops` before its feed-forward."""
    d, q = model.dim, _q_dim(model)
    return 2 * (2 * d * q + 2 * d * _kv_dim(model)) / tp + 2 * seq_len * q / tp


def head_forward_flops(model: TransformerShape, tp: int) -> float:
    """Forward FLOPs per token of the output head on one of ``tp`` ranks."""
    return 2 * model.dim * model.vocab_size / tp


def block_activation_bytes(
    model: TransformerShape,
    index: int,
    tokens: int,
    seq_len: int,
    tp: int,
    precision: Precision,
    *,
    flash_attention: bool = True,
) -> int:
    """Bytes block ``index`` saves for backward for ``tokens`` tokens without checkpointing
    (:func:`hp_planner.price.activation.block_activations`' ``full``)."""
    return block_activations(
        model, index, tokens, seq_len, tp, precision.compute, flash_attention=flash_attention
    ).full


def head_activation_bytes(model: TransformerShape, tokens: int, precision: Precision) -> int:
    """Bytes the final norm and the output head save for ``tokens`` tokens: the norm's input,
    its scaled input and output (the head's input), its reciprocal RMS (compute dtype), and
    what the cross entropy keeps: the fp32 log-softmax of the logits, the int64 targets and
    its fp32 total weight."""
    per_token = (3 * model.dim + 1) * precision.compute + model.vocab_size * 4 + 8
    return int(tokens * per_token) + 4


def loss_gradient_bytes(model: TransformerShape, tokens: int) -> int:
    """Bytes the first step of backward holds at once: the gradients of the log-softmax and
    of the fp32 logits, one vocabulary row of fp32 per token each."""
    return int(2 * tokens * model.vocab_size * 4)
