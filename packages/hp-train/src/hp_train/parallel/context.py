"""Context parallelism in the main job: each sequence split ``cp`` ways (zigzag), attention
across the pieces (ring or Ulysses, ``hp_dtensor.parallel.ContextParallel``).

The ``cp`` ranks of a data-parallel rank read the same sequences; each keeps its
:func:`hp_dtensor.parallel.shard_sequence` columns of the token ids and targets and the global
positions of those columns (the rotary tables are looked up at them). The model knows them
too (:attr:`~hp_train.model.llama.Transformer.column_positions`): a pipeline stage after the
first receives only hidden states of those columns, from the same ``cp`` rank of the stage
before (:mod:`hp_train.parallel.pipeline`). Only the attention
cores (``layers.<i>.attn.core``, parameter-free) are replaced; every parameter stays
replicated over ``cp`` and FSDP shards and reduces over ``dp_shard x cp`` as one axis. The
zigzag split gives every rank the same number of tokens, so the mean of the ranks' local
token means FSDP's averaging takes is the global token mean of the batch.
"""

from __future__ import annotations

import torch

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import (
    ContextParallel,
    local_positions,
    parallelize_module,
    shard_sequence,
)
from hp_train.data.loader import Batch
from hp_train.model.llama import Transformer

__all__ = ["CP_AXIS", "ColumnPositions", "ShardedBatch", "apply_context_parallel", "shard_batch"]

#: The name of the context-parallel axis (``hp_train.parallel.parallelize.build_layout``).
CP_AXIS = "cp"


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh, variant: str) -> None:
    """Replace every block's attention core by ``variant``'s context-parallel attention over
    ``cp_mesh`` (1-d, axis ``cp``), zigzag-balanced: hp-dtensor's production executor applies
    the :class:`~hp_dtensor.parallel.ContextParallel` style to each core (parameter-free; no
    data axis: FSDP reduces over those). Afterwards ``model``'s forward, given ``n`` columns
    without positions, takes them as this rank's columns (:class:`ColumnPositions`)."""
    model.column_positions = ColumnPositions(cp_mesh)
    style = ContextParallel(variant=variant, balanced=True)
    for block in model.layers.values():
        parallelize_module(
            block.get_submodule("attn.core"),
            cp_mesh,
            {"": style},
            mode="production",
            tp_axis=CP_AXIS,
            dp_axes=(),
        )


class ColumnPositions:
    """The global positions of this ``cp`` rank's columns, by how many it holds.

    ``ColumnPositions(cp_mesh)(n)`` is, for ``n`` local columns of sequences of ``n x cp``
    tokens, the int64 ``[n]`` positions :func:`shard_batch` gives with them, on
    ``cp_mesh``'s device; computed once per ``n``.
    """

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.cp_mesh = cp_mesh
        self._known: dict[int, torch.Tensor] = {}

    def __call__(self, local: int) -> torch.Tensor:
        found = self._known.get(local)
        if found is None:
            seq = local * self.cp_mesh.size()
            found = local_positions(seq, self.cp_mesh, CP_AXIS, device=self.cp_mesh.device)
            self._known[local] = found
        return found


class ShardedBatch:
    """This rank's columns of a batch and their global positions.

    Attributes:
        inputs: token ids ``[batch, seq / cp]``.
        targets: next tokens, the same columns.
        positions: the global position of each column (int64 ``[seq / cp]``).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor):
        self.inputs = inputs
        self.targets = targets
        self.positions = positions


def shard_batch(batch: Batch, cp_mesh: DeviceMesh) -> ShardedBatch:
    """This rank's zigzag columns of ``batch`` (whole sequences of its data-parallel rank)."""
    seq = batch.inputs.shape[1]
    device = batch.inputs.device
    return ShardedBatch(
        shard_sequence(batch.inputs, 1, cp_mesh, CP_AXIS),
        shard_sequence(batch.targets, 1, cp_mesh, CP_AXIS),
        local_positions(seq, cp_mesh, CP_AXIS, device=device),
    )
