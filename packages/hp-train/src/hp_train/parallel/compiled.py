"""``TrainConfig.compile``: each block's attention and feed-forward compiled with
``torch.compile`` (inductor), after the parallel plans replaced their forwards and before
FSDP, whose hooks on the block stay outside the compiled code."""

from __future__ import annotations

from torch import nn

__all__ = ["compile_blocks"]


def compile_blocks(blocks: list[nn.Module]) -> None:
    """Compile the ``attn`` and ``ffn`` submodules of every block, in place."""
    for block in blocks:
        for name in ("attn", "ffn"):
            part = getattr(block, name)
            part.compile()
