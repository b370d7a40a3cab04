"""Per-rank memory of a step: parameters, gradients, optimizer state, activations, buffers.

* parameters: this rank's FSDP chunks, ``sum(chunk_numel) x precision.param`` (hp_fsdp keeps
  each group's chunk in one flat buffer, padding included; an expert group's chunk is of its
  ``n_experts / ep`` local experts);
* gradients: the reduced chunks, ``sum(chunk_numel) x precision.reduce`` (hp_fsdp's gradient
  arena allocates one chunk per group);
* optimizer state: Muon keeps one momentum buffer shaped like each Muon parameter's local
  piece; AdamW two moments (``exp_avg``, ``exp_avg_sq``) per piece plus its 4-byte ``step``
  counter (with ``optimizer="adamw"`` every parameter is AdamW's);
* offload (``TrainConfig.offload``): ``optimizer`` keeps the optimizer state in host memory
  between steps (the step streams it through the device bucket by bucket: not counted);
  ``params`` keeps the sharded parameters and gradients in host memory (and so the optimizer
  step and its state); ``both`` all of them;
* activations: what every block keeps under the checkpointing policy
  (:mod:`~hp_planner.price.activation`) times the microbatches in flight (1, or the pipeline
  schedule's peak on the stage, :func:`~hp_planner.price.schedule.in_flight`), plus the
  largest transient of one block recomputed in backward; with ``swap`` a block keeps on the
  device only its tensors below the swapper's threshold, the rest is in host memory
  (:attr:`MemoryBreakdown.host`) and backward fetches two blocks' back at once (the one in
  backward and the previous one, prefetched: :attr:`MemoryBreakdown.fetched`);
* buffers: the root's unsharded parameters (the root keeps them from forward to backward) and
  its unsharded gradient buffer, the unsharded parameters of the block being computed (with
  its MoE layer's expert group) and of the prefetched one, the unsharded gradient buffers of
  the block in backward and of the one whose reduce-scatter is in flight, the reduce-dtype
  copy a reduce-scatter sends when it differs from the compute dtype, and the FP8 wire buffer
  of an FP8 all-gather (one byte per element and a 4-byte scale per 128).

Under the modeled baselines (:data:`~hp_planner.price.workload.RUNTIMES`): torch FSDP2 adds its
copy-out buffer of the block being gathered; Megatron DDP holds every parameter of its split
(the groups in one chunk), its gradients and optimizer state, plus the compute-dtype copy of
the parameters, and gathers nothing.

The peak is the larger of two moments of backward, where every kept activation still exists
(forward ends with less: the loss has not been differentiated yet):

* backward start: parameters, optimizer state, every kept activation, the parameter buffers
  (the root's unsharded parameters, the last block's re-gathered for its backward and the
  prefetched one) and the logits' gradients;
* first reduce-scatter: the same less the head's and the last block's activations (freed by
  then), plus the gradients, the one block rebuilt by recomputation and every gradient buffer
  (the root's unsharded gradients, the block in backward and the one being reduced, their
  reduce-dtype copy), and with ``swap`` the two blocks fetched back.

Gradients are none between steps (``zero_grad`` sets them to None) and the arena's chunks are
allocated at the first reduce-scatter. Checked against the peak of the bytes a real step's
tensors hold at world 4 (FSDP, FSDP x TP, FSDP x EP: hp-train's
``tests/test_dryrun_vs_measured.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_planner.inputs import JobDims
from hp_planner.price.activation import KeptActivations, block_activations, kept_activations
from hp_planner.price.model import TransformerShape
from hp_planner.price.structure import GroupSpec
from hp_planner.price.workload import StepShape, head_activation_bytes, loss_gradient_bytes
from hp_planner.recipe import SWAP_MIN_BYTES

__all__ = [
    "FP8_BLOCK",
    "GIB",
    "MemoryBreakdown",
    "block_kept",
    "fp8_record_bytes",
    "memory_breakdown",
]

GIB = 2**30

FP8_BLOCK = 128
"""Elements per fp32 scale of an FP8 all-gather (``hp_train.parallel.precision``)."""


def fp8_record_bytes(numel: int) -> int:
    """Bytes one rank contributes to an FP8 all-gather of its ``numel``-element shard:
    hp-fsdp's record, e4m3 data padded to 4 bytes, then one fp32 scale per
    :data:`FP8_BLOCK` elements."""
    return -(-numel // 4) * 4 + 4 * -(-numel // FP8_BLOCK)


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory in bytes.

    Attributes:
        parameters: sharded parameters.
        gradients: sharded (reduced) gradients.
        optimizer: optimizer state.
        muon_state: the part of ``optimizer`` that is Muon momentum.
        activations: saved activations (all microbatches in flight) plus ``transient``.
        activations_by_layer: ``(layer, bytes)`` saved per microbatch, in forward order.
        buffers: ``(name, bytes)`` of FSDP's buffers, those of the parameters first
            (:attr:`parameter_buffers` of them), then those of the gradients.
        host: bytes offloaded to host memory (not in :attr:`total`).
        parameter_buffers: how many leading entries of ``buffers`` exist from forward to
            backward (unsharded and copied parameters); the rest exist during backward only.
        transient: one block's activations rebuilt while it is recomputed in backward.
        loss_gradient: what the first step of backward holds (the logits' gradients).
        first_freed: activations backward frees before the first reduce-scatter starts
            (the head's and the last block's, one microbatch).
        fetched: swapped activations on the device at once in backward (the two largest
            blocks' of one microbatch; 0 without swap).
        swapped: activations in host memory at the end of forward (every microbatch in
            flight; not in :attr:`total` nor :attr:`host`).
    """

    parameters: int
    gradients: int
    optimizer: int
    muon_state: int
    activations: int
    activations_by_layer: tuple[tuple[str, int], ...]
    buffers: tuple[tuple[str, int], ...]
    host: int = 0
    parameter_buffers: int = 0
    transient: int = 0
    loss_gradient: int = 0
    first_freed: int = 0
    fetched: int = 0
    swapped: int = 0

    @property
    def buffer_total(self) -> int:
        """Bytes of all buffers."""
        return sum(b for _, b in self.buffers)

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def phases(self) -> dict[str, int]:
        """Bytes held at the moments a step's memory can peak (module doc)."""
        kept = self.activations - self.transient
        held = self.parameters + self.optimizer
        params = sum(b for _, b in self.buffers[: self.parameter_buffers])
        grads = sum(b for _, b in self.buffers[self.parameter_buffers :])
        return {
            "backward start": held + kept + params + self.loss_gradient,
            "first reduce-scatter": held
            + self.gradients
            + kept
            - self.first_freed
            + self.transient
            + self.fetched
            + params
            + grads,
        }

    @property
    def saved_peak(self) -> int:
        """The most bytes of saved activations the device holds at once (what
        ``hp_offload.memory.ActivationMeter`` reports as its peak): every kept activation at
        the end of forward, or with ``swap`` the swapped blocks fetched back in backward
        beside what backward has not freed."""
        kept = self.activations - self.transient
        return max(kept, kept - self.first_freed + self.fetched)

    @property
    def total(self) -> int:
        """The peak estimate: the larger of :attr:`phases`."""
        return max(self.phases.values())


def _units(groups: tuple[GroupSpec, ...]) -> list[int]:
    """Padded elements gathered at once per block (its group and its MoE layer's)."""
    per_block: dict[int, int] = {}
    for g in groups:
        if g.block is not None:
            per_block[g.block] = per_block.get(g.block, 0) + g.flat.padded_numel
    return list(per_block.values())


_OPTIMIZER_STATE: dict[tuple[int, tuple[int, int], str], tuple[object, tuple[int, int, int]]] = {}


def _optimizer_state(
    groups: tuple[GroupSpec, ...], shard_coordinates: tuple[int, int], optimizer: str
) -> tuple[int, int, int]:
    """Elements of optimizer state on the rank: AdamW's two moments, Muon's momentum, and
    how many parameters AdamW steps (``groups`` cached by identity, as ``fsdp_groups``
    returns them: the search asks once per microbatch count and policy)."""
    key = (id(groups), shard_coordinates, optimizer)
    cached = _OPTIMIZER_STATE.get(key)
    if cached is not None and cached[0] is groups:
        return cached[1]
    moments = momentum = adamw_params = 0
    dense, expert = shard_coordinates
    for g in groups:
        coordinate = expert if g.is_experts else dense
        for p, n in zip(g.params, g.local_numels(coordinate), strict=True):
            if optimizer == "muon" and p.optimizer == "muon":
                momentum += n
            else:
                moments += 2 * n
                adamw_params += 1
    _OPTIMIZER_STATE[key] = (groups, (moments, momentum, adamw_params))
    return moments, momentum, adamw_params


def block_kept(
    model: TransformerShape, index: int, tokens: int, shape: StepShape, parallel: JobDims
) -> KeptActivations:
    """What block ``index`` keeps for ``tokens`` tokens of a rank under ``shape``'s policy
    and swap, at ``parallel``'s degrees (:func:`~hp_planner.price.activation.block_activations`
    and :func:`~hp_planner.price.activation.kept_activations`)."""
    acts = block_activations(
        model,
        index,
        tokens,
        shape.seq_len,
        parallel.tp,
        shape.precision.compute,
        flash_attention=shape.flash_attention,
        cp=parallel.cp,
        cp_variant=parallel.cp_variant,
        ep_tp=parallel.ep_tp,
        swap_min_bytes=SWAP_MIN_BYTES if shape.swap else None,
    )
    return kept_activations(acts, shape.ac, shape.ac_budget_bytes, swap=shape.swap)


@dataclass(frozen=True)
class _Saved:
    """The activations a rank's stage saves per microbatch (module doc).

    Attributes:
        by_layer: ``(layer, bytes)`` each block keeps on the device, in forward order, then
            the head's.
        swapped: each block's bytes in host memory.
        transient: the largest block's activations rebuilt while it is recomputed.
        first_freed: the head's and the last block's (freed before the first
            reduce-scatter).
        fetched: the two largest swapped blocks' (on the device at once in backward).
    """

    by_layer: tuple[tuple[str, int], ...]
    swapped: tuple[int, ...]
    transient: int
    first_freed: int
    fetched: int


def _saved(
    model: TransformerShape,
    groups: tuple[GroupSpec, ...],
    shape: StepShape,
    parallel: JobDims,
    microbatch_tokens: int,
    head: bool,
) -> _Saved:
    """What the blocks of ``groups`` (and the head when ``head``) save for
    ``microbatch_tokens`` tokens under ``shape``'s policy and swap (:func:`block_kept`)."""
    by_layer: list[tuple[str, int]] = []
    swapped: list[int] = []
    transient = 0
    for g in groups:
        if g.block is None or g.is_experts:
            continue
        kept = block_kept(model, g.block, microbatch_tokens, shape, parallel)
        transient = max(transient, kept.transient)
        by_layer.append((g.name, kept.on_device))
        swapped.append(kept.swapped)
    if head:
        by_layer.append(("head", head_activation_bytes(model, microbatch_tokens, shape.precision)))
    blocks = [b for name, b in by_layer if name != "head"]
    first_freed = (by_layer[-1][1] if head else 0) + (blocks[-1] if blocks else 0)
    fetched = sum(sorted(swapped)[-2:])
    return _Saved(tuple(by_layer), tuple(swapped), transient, first_freed, fetched)


def _buffers(
    groups: tuple[GroupSpec, ...], shape: StepShape, chunks: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """FSDP's buffers on the rank (module doc): those of the parameters (from forward to
    backward), then those of the gradients (backward only); ``chunks``: the elements of the
    rank's chunks (what Megatron DDP holds whole)."""
    prec = shape.precision
    units = _units(groups)
    root = [g.flat.padded_numel for g in groups if g.is_root]
    largest = max(units, default=0)
    buffers: list[tuple[str, int]] = []
    if shape.runtime == "megatron_ddp":
        # Replicated parameters: the compute-dtype copy the model runs on, no gathers.
        if prec.compute != prec.param:
            buffers.append(("compute-dtype params", chunks * prec.compute))
        root, largest = [], 0
    elif shape.runtime == "torch_fsdp2" and largest:
        buffers.append(("copy-out buffers", largest * prec.compute))
    gradient_buffers: list[tuple[str, int]] = []
    if root:
        buffers.append(("root unsharded params", root[0] * prec.compute))
        gradient_buffers.append(("root unsharded grads", root[0] * prec.compute))
    if largest:
        gathered = 2 if shape.prefetch else 1
        buffers.append(("block unsharded params", gathered * largest * prec.compute))
        if shape.fp8_all_gather:
            # The records of every rank (each rank's padding and last partial block aside).
            wire = fp8_record_bytes(largest)
            buffers.append(("fp8 all-gather wire", gathered * wire))
        gradient_buffers.append(("block unsharded grads", 2 * largest * prec.compute))
        if prec.reduce != prec.compute:
            gradient_buffers.append(("reduce-scatter cast", largest * prec.reduce))
    return buffers, gradient_buffers


def memory_breakdown(
    model: TransformerShape,
    groups: tuple[GroupSpec, ...],
    shape: StepShape,
    *,
    shard_coordinates: tuple[int, int],
    parallel: JobDims,
    microbatch_tokens: int,
    in_flight: int = 1,
    head: bool = True,
) -> MemoryBreakdown:
    """Memory of the rank holding ``groups`` (see the module doc).

    ``shard_coordinates``: the rank's chunk of the dense groups and of the expert groups;
    ``microbatch_tokens``: this rank's tokens per microbatch (``1 / cp`` of its sequences);
    ``head``: the rank's stage computes the final norm and the output head.

    Postconditions: without offload, ``parameters`` and ``gradients`` are exactly
    ``sum(chunk_numel)`` times the element sizes; ``optimizer`` counts the rank's pieces (no
    padding) exactly.
    """
    prec = shape.precision
    chunks = sum(g.flat.chunk_numel for g in groups)
    moments, momentum, adamw_params = _optimizer_state(groups, shard_coordinates, shape.optimizer)
    muon_state = momentum * prec.optimizer
    # AdamW's two moments, and its 4-byte step counter per parameter it steps.
    optimizer = moments * prec.optimizer + 4 * adamw_params + muon_state
    saved = _saved(model, groups, shape, parallel, microbatch_tokens, head)
    buffers, gradient_buffers = _buffers(groups, shape, chunks)
    params_on_device = shape.offload not in ("params", "both")
    optimizer_on_device = params_on_device and shape.offload != "optimizer"
    return MemoryBreakdown(
        parameters=chunks * prec.param if params_on_device else 0,
        gradients=chunks * prec.reduce if params_on_device else 0,
        optimizer=optimizer if optimizer_on_device else 0,
        muon_state=muon_state if optimizer_on_device else 0,
        activations=in_flight * sum(b for _, b in saved.by_layer) + saved.transient,
        activations_by_layer=saved.by_layer,
        buffers=(*buffers, *gradient_buffers),
        parameter_buffers=len(buffers),
        transient=saved.transient,
        loss_gradient=loss_gradient_bytes(model, microbatch_tokens) if head else 0,
        first_freed=saved.first_freed,
        host=(0 if params_on_device else chunks * (prec.param + prec.reduce))
        + (0 if optimizer_on_device else optimizer),
        fetched=saved.fetched,
        swapped=in_flight * sum(saved.swapped),
    )
