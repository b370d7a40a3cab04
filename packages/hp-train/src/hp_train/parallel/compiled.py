"""``TrainConfig.compile``: each block's attention and feed-forward compiled with
``torch.compile`` (inductor), after the parallel plans replaced their forwards and before
FSDP.

What is compiled is each part's ``forward``, not its module call: the hooks on the module
(FSDP's gather and reshard on an expert-parallel MoE, which FSDP shards as a group of its
own; the exact region's gradient conversions) run eager around the compiled code, so a
collective in a hook never becomes a graph break.

Context and expert parallelism exchange tensors inside those forwards. The design is to
compile everything around the exchanges and run the exchanges themselves eager, marked
``torch.compiler.disable`` where hp-dtensor defines them:

* the context-parallel attention core
  (``hp_dtensor.parallel.context_attention.context_parallel_attention``): the ring's
  point-to-point shifts cannot be traced, and they sit inside the loop over ring steps, where
  a graph cannot resume; so the core is one eager call between two graphs (the q/k/v
  projections, norms and rotary embedding before; the output projection after);
* the expert-parallel dispatch (``hp_dtensor.parallel.expert.exchange_through_experts``): the
  count all-gather, the ragged all-to-all, the local experts on the rows received and the
  all-to-all back, where every size depends on the routing of every rank; so the MoE is the
  routing (one graph), the eager dispatch, then the combine, shared experts and
  load-balancing loss (a second graph), whose shapes depend on the token count only.

The alternative, compiling only the submodules that never exchange (the projections, the
experts' matmuls) and leaving the parts' forwards eager, would compile the experts' matmuls
at data-dependent row counts (a recompilation per count, or dynamic shapes specialized at 0
and 1 rows) and leave the routing, rotary and combine arithmetic eager. With this design a
traced part has one graph break per exchange and no other, and every shape a graph sees is
fixed by the batch, so each code object is compiled once per grad mode (training; the
no-grad probe and evaluation), not once per step. What stays eager: the ring's blockwise
attention and Ulysses' SDPA (inside the core) and the routed experts' matmuls (inside the
dispatch).

Under a torch dispatch mode (``hp_fsdp.counting.CountingMode``, for one) dynamo skips every
frame: such a run is eager throughout.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["COMPILED_PARTS", "compile_blocks"]

#: The submodules of a block whose forwards are compiled.
COMPILED_PARTS = ("attn", "ffn")


def compile_blocks(blocks: list[nn.Module]) -> None:
    """Compile the ``forward`` of the ``attn`` and ``ffn`` submodules of every block, in
    place (module docstring).

    Postcondition: calling the part runs its hooks eager and its forward through
    ``torch.compile`` (inductor), compiled on first call; the exchanges of context- and
    expert-parallel forwards run eager inside it.
    """
    for block in blocks:
        for name in COMPILED_PARTS:
            part = getattr(block, name)
            # An instance attribute: the plan's own forward where it replaced the class's.
            part.forward = torch.compile(part.forward)
