"""Ready-made tensor-parallel plans for Llama-style transformers.

Megatron's split: attention projections q/k/v and the MLP's gate and up projections
column-parallel, the attention output and MLP down projections row-parallel, the embedding
vocabulary-parallel, the LM head column-parallel. With sequence parallelism, the activations
between blocks are sharded on the sequence (norms and dropouts run on the shards); the
attention and MLP inputs are gathered and their outputs reduce-scattered. Module names follow
torchtitan's Llama (and ``hp_testing.llama``); give :class:`TransformerNames` for others.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_dtensor.parallel.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)
from hp_layout import Replicate, Shard

__all__ = ["TransformerNames", "transformer_tp_plan"]


@dataclass(frozen=True)
class TransformerNames:
    """Module names of a Llama-style transformer (patterns; ``*`` is one dotted component).

    Attributes:
        embedding: the token embedding.
        blocks: the transformer blocks.
        attention: the attention module inside a block (its first input is the hidden states).
        q, k, v, o: the attention projections inside ``attention``.
        mlp: the MLP inside a block.
        gate, up, down: the MLP's projections inside ``mlp``.
        norms: the norms inside a block.
        dropouts: the dropouts inside a block.
        final_norm: the norm before the LM head.
        head: the LM head.
    """

    embedding: str = "tok_embeddings"
    blocks: str = "layers.*"
    attention: str = "attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    mlp: str = "ffn"
    gate: str = "w1"
    up: str = "w3"
    down: str = "w2"
    norms: tuple[str, ...] = ("attn_norm", "ffn_norm")
    dropouts: tuple[str, ...] = ("attn_dropout", "ffn_dropout")
    final_norm: str = "norm"
    head: str = "output"


def transformer_tp_plan(
    *,
    sequence_parallel: bool = False,
    vocab_parallel_logits: bool = False,
    names: TransformerNames = TransformerNames(),
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a Llama-style transformer.

    Args:
        sequence_parallel: shard the activations between blocks on the sequence dim (1).
        vocab_parallel_logits: keep the logits sharded on the vocabulary (compute the loss
            under :func:`hp_dtensor.parallel.loss_parallel`); otherwise they are gathered.
        names: the model's module names.
    """
    n = names
    block = n.blocks
    attn = f"{block}.{n.attention}"
    mlp = f"{block}.{n.mlp}"
    between: Shard | Replicate = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if vocab_parallel_logits else Replicate()
    plan: dict[str, ParallelStyle] = {
        n.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        f"{attn}.{n.q}": ColwiseParallel(),
        f"{attn}.{n.k}": ColwiseParallel(),
        f"{attn}.{n.v}": ColwiseParallel(),
        f"{attn}.{n.o}": RowwiseParallel(output_layouts=between),
        f"{mlp}.{n.gate}": ColwiseParallel(),
        f"{mlp}.{n.up}": ColwiseParallel(),
        f"{mlp}.{n.down}": RowwiseParallel(output_layouts=between),
        n.head: ColwiseParallel(input_layouts=between, output_layouts=logits),
    }
    if sequence_parallel:
        for name in (*n.norms, *n.dropouts):
            plan[f"{block}.{name}"] = SequenceParallel()
        plan[n.final_norm] = SequenceParallel()
        # The hidden states are the attention's first input; others (rotary tables) stay.
        plan[attn] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan[mlp] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        # Nothing moves at a block's edge; the placements are recorded for a caller that runs
        # the blocks itself (the sum a block returns carries none of its own).
        plan[block] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Shard(1),),
            output_layouts=Shard(1),
            desired_output_layouts=Shard(1),
        )
    return plan
