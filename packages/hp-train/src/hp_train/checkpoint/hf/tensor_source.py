"""Where one hp-train tensor lies in a Hugging Face checkpoint: which stored tensors, and which
parts of them.

Three cases cover Llama, Qwen2/3, Qwen3-MoE and Mixtral:

* ``"whole"``: one stored tensor of the same shape (every dense tensor, a router's gate, a
  fused ``down_proj`` stack);
* ``"stacked"``: an expert stack ``[E, a, b]`` of which expert ``e`` is the stored ``[a, b]``
  tensor ``names[e]`` (the per-expert files ``save_pretrained`` writes);
* ``"rows"``: rows ``[offset, offset + shape[1])`` along dim 1 of one stored stack (``w1`` and
  ``w3`` inside a fused ``gate_up_proj`` ``[E, 2 * hidden, dim]``).

Pure planning: :meth:`Source.reads` says which boxes of which stored tensors make a box of the
hp-train tensor, :meth:`Source.split` cuts a whole hp-train tensor into the stored ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Box", "Source", "SourceKind"]

SourceKind = Literal["whole", "stacked", "rows"]

#: ``[start, stop)`` along each dim.
Box = list[tuple[int, int]]


@dataclass(frozen=True)
class Source:
    """One hp-train tensor in a Hugging Face checkpoint.

    Attributes:
        own: hp-train's name (``layers.0.ffn.experts.w1``).
        shape: hp-train's (global) shape.
        kind: see the module docstring.
        names: the stored tensors: one for ``"whole"`` and ``"rows"``, one per expert for
            ``"stacked"``.
        stored: the shape of each stored tensor.
        offset: ``"rows"`` only: the first row along dim 1.
    """

    own: str
    shape: tuple[int, ...]
    kind: SourceKind
    names: tuple[str, ...]
    stored: tuple[int, ...]
    offset: int = 0

    def __post_init__(self) -> None:
        if self.kind == "stacked":
            consistent = len(self.names) == self.shape[0] and self.stored == self.shape[1:]
        elif self.kind == "rows":
            consistent = (
                len(self.names) == 1
                and len(self.shape) == len(self.stored) == 3
                and self.stored[0] == self.shape[0]
                and self.stored[2] == self.shape[2]
                and 0 <= self.offset <= self.stored[1] - self.shape[1]
            )
        else:
            consistent = len(self.names) == 1 and self.stored == self.shape
        if not consistent:
            raise ValueError(f"inconsistent source of {self.own}: {self}")

    def reads(self, box: Sequence[tuple[int, int]]) -> list[tuple[str, Box]]:
        """The stored boxes that make box ``box`` of the hp-train tensor, in order.

        Postcondition: stacking the ``"stacked"`` reads along a new dim 0 (taking the one read
        of the other kinds as it is) gives exactly that box; nothing outside it is read.
        """
        if len(box) != len(self.shape):
            raise ValueError(f"{self.own}: a box of {len(box)} dims for shape {self.shape}")
        if self.kind == "whole":
            return [(self.names[0], list(box))]
        if self.kind == "rows":
            (e0, e1), (r0, r1), cols = box
            return [(self.names[0], [(e0, e1), (self.offset + r0, self.offset + r1), cols])]
        (e0, e1), *inner = box
        return [(self.names[e], list(inner)) for e in range(e0, e1)]

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of the whole hp-train tensor ``tensor`` (fresh memory each, so
        safetensors may write them side by side).

        Raises:
            ValueError: a ``"rows"`` source (a fused stack is written from two hp-train
                tensors, not cut from one), or ``tensor`` is not of :attr:`shape`.
        """
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"{self.own}: got shape {tuple(tensor.shape)}, expected {self.shape}")
        if self.kind == "rows":
            raise ValueError(f"{self.own} is part of the fused {self.names[0]}; it cannot be split")
        if self.kind == "whole":
            return {self.names[0]: tensor}
        return {name: tensor[e].clone() for e, name in enumerate(self.names)}
