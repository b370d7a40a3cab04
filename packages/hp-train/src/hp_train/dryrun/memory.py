"""Per-rank memory of a step: parameters, gradients, optimizer state, activations, buffers.

* parameters: this rank's FSDP chunks, ``sum(chunk_numel) x precision.param`` (hp_fsdp keeps
  each group's chunk in one flat buffer, padding included);
* gradients: the reduced chunks, ``sum(chunk_numel) x precision.reduce`` (hp_fsdp's gradient
  arena allocates one chunk per group);
* optimizer state: Muon keeps one momentum buffer shaped like each Muon parameter's local
  piece; AdamW two moments (``exp_avg``, ``exp_avg_sq``) per piece plus its 4-byte ``step``
  counter (with ``optimizer="adamw"`` every parameter is AdamW's);
* activations: what every layer saves for backward (:mod:`hp_train.dryrun.workload`), times
  the microbatches in flight (1, or ``min(pp - stage, microbatches)`` under 1F1B);
* buffers: the root's unsharded parameters (the root keeps them from forward to backward) and
  its unsharded gradient buffer, the unsharded parameters of the block being computed (and of
  the prefetched one), the unsharded gradient buffers of the block in backward and of the one
  whose reduce-scatter is in flight, and the reduce-dtype copy a reduce-scatter sends when it
  differs from the compute dtype.

The peak is taken as the plain sum (a conservative bound: not every buffer peaks at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_train.config import ModelConfig
from hp_train.dryrun.shapes import GroupSpec
from hp_train.dryrun.workload import (
    StepShape,
    block_activation_bytes,
    head_activation_bytes,
)

__all__ = ["GIB", "MemoryBreakdown", "memory_breakdown"]

GIB = 2**30


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory in bytes.

    Attributes:
        parameters: sharded parameters.
        gradients: sharded (reduced) gradients.
        optimizer: optimizer state.
        muon_state: the part of ``optimizer`` that is Muon momentum.
        activations: peak saved activations (all microbatches in flight).
        activations_by_layer: ``(layer, bytes)`` saved per microbatch, in forward order.
        buffers: ``(name, bytes)`` of FSDP's transient buffers.
    """

    parameters: int
    gradients: int
    optimizer: int
    muon_state: int
    activations: int
    activations_by_layer: tuple[tuple[str, int], ...]
    buffers: tuple[tuple[str, int], ...]

    @property
    def buffer_total(self) -> int:
        """Bytes of all buffers."""
        return sum(b for _, b in self.buffers)

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """The peak estimate: everything summed."""
        return self.state + self.activations + self.buffer_total


def memory_breakdown(
    model: ModelConfig,
    groups: tuple[GroupSpec, ...],
    shape: StepShape,
    *,
    shard_coordinate: int,
    tp: int,
    microbatch_tokens: int,
    in_flight: int = 1,
    head: bool = True,
) -> MemoryBreakdown:
    """Memory of the rank at ``shard_coordinate`` holding ``groups`` (see the module doc).

    ``head``: the rank's stage computes the final norm and the output head.

    Postconditions: ``parameters`` and ``gradients`` are exactly ``sum(chunk_numel)`` times
    the element sizes; ``optimizer`` counts the rank's pieces (no padding) exactly.
    """
    prec = shape.precision
    chunks = sum(g.flat.chunk_numel for g in groups)
    optimizer = muon_state = 0
    for g in groups:
        for p, n in zip(g.params, g.local_numels(shard_coordinate), strict=True):
            if shape.optimizer == "muon" and p.optimizer == "muon":
                muon_state += n * prec.optimizer
            else:
                optimizer += 2 * n * prec.optimizer + 4
    optimizer += muon_state
    by_layer: list[tuple[str, int]] = []
    full_blocks: list[int] = []
    for g in groups:
        if g.is_root:
            continue
        index = int(g.name.split(".")[1])
        full = block_activation_bytes(
            model,
            index,
            microbatch_tokens,
            shape.seq_len,
            tp,
            prec,
            flash_attention=shape.flash_attention,
        )
        full_blocks.append(full)
        kept = microbatch_tokens * model.dim * prec.compute if shape.recompute else full
        by_layer.append((g.name, kept))
    if head:
        by_layer.append(("head", head_activation_bytes(model, microbatch_tokens, prec)))
    activations = in_flight * sum(b for _, b in by_layer)
    if shape.recompute and full_blocks:
        activations += max(full_blocks)
    blocks = [g.flat.padded_numel for g in groups if not g.is_root]
    root = [g.flat.padded_numel for g in groups if g.is_root]
    largest = max(blocks, default=0)
    buffers: list[tuple[str, int]] = []
    if root:
        buffers.append(("root unsharded params", root[0] * prec.compute))
        buffers.append(("root unsharded grads", root[0] * prec.compute))
    if largest:
        gathered = 2 if shape.prefetch else 1
        buffers.append(("block unsharded params", gathered * largest * prec.compute))
        buffers.append(("block unsharded grads", 2 * largest * prec.compute))
        if prec.reduce != prec.compute:
            buffers.append(("reduce-scatter cast", largest * prec.reduce))
    return MemoryBreakdown(
        parameters=chunks * prec.param,
        gradients=chunks * prec.reduce,
        optimizer=optimizer,
        muon_state=muon_state,
        activations=activations,
        activations_by_layer=tuple(by_layer),
        buffers=tuple(buffers),
    )
