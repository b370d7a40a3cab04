"""The tensors of an MoE feed-forward in Qwen3-MoE and Mixtral checkpoints, as Transformers 5
stores them.

hp-train's MoE block ``layers.{i}.ffn`` holds the router's gate ``router.weight`` ``[E, dim]``
and the expert stacks ``experts.w1``, ``experts.w3`` ``[E, hidden, dim]`` and ``experts.w2``
``[E, dim, hidden]``. Transformers 5 keeps two layouts of them:

* ``"per_expert"``, what ``save_pretrained`` writes (it reverts the model's fusion on save, so
  the files are those of the Hub and of Transformers 4): one ``[hidden, dim]`` / ``[dim,
  hidden]`` tensor per expert, ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``
  and the gate ``mlp.gate.weight`` (Qwen3-MoE), or
  ``model.layers.{i}.block_sparse_moe.experts.{e}.w{1,3,2}.weight`` and
  ``block_sparse_moe.gate.weight`` (Mixtral);
* ``"fused"``, the model's own parameters, which ``from_pretrained`` also reads as they are:
  ``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2 * hidden, dim]`` (``w1``'s rows, then
  ``w3``'s), ``mlp.experts.down_proj`` ``[E, dim, hidden]`` and ``mlp.gate.weight``, for both.

Each matrix is ``[out, in]`` in both programs, so no tensor is transposed.
"""

from __future__ import annotations

from typing import Literal

from hp_train.checkpoint.hf.tensor_source import Source

__all__ = ["EXPERT_LAYOUTS", "ExpertLayout", "fused_marker", "moe_block_sources"]

ExpertLayout = Literal["per_expert", "fused"]

#: The layouts :func:`moe_block_sources` maps.
EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("per_expert", "fused")

# Per-expert file names: (block module, gate/w1, up/w3, down/w2), by model_type.
_PER_EXPERT = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def fused_marker(index: int) -> str:
    """The stored name that only a fused checkpoint has for MoE layer ``index``."""
    return f"model.layers.{index}.mlp.experts.gate_up_proj"


def moe_block_sources(
    family: str,
    layout: ExpertLayout,
    index: int,
    *,
    dim: int,
    hidden: int,
    experts: int,
) -> list[Source]:
    """The sources of hp-train's MoE block ``layers.{index}.ffn`` (router, ``w1``, ``w2``,
    ``w3``) in a ``family`` (``"qwen3_moe"`` or ``"mixtral"``) checkpoint of ``layout``.

    Postcondition: their stored tensors are exactly those ``transformers``' layer ``index``
    feed-forward has in that layout, with their shapes.

    Raises:
        ValueError: an unknown family or layout.
    """
    if family not in _PER_EXPERT:
        raise ValueError(f"no MoE architecture {family!r}; known: {sorted(_PER_EXPERT)}")
    own = f"layers.{index}.ffn"
    up, down = (experts, hidden, dim), (experts, dim, hidden)
    if layout == "fused":
        block = f"model.layers.{index}.mlp"
        fused = (fused_marker(index),)
        stored = (experts, 2 * hidden, dim)
        return [
            Source(f"{own}.router.weight", (experts, dim), "whole", (f"{block}.gate.weight",),
                   (experts, dim)),
            Source(f"{own}.experts.w1", up, "rows", fused, stored, offset=0),
            Source(f"{own}.experts.w2", down, "whole", (f"{block}.experts.down_proj",), down),
            Source(f"{own}.experts.w3", up, "rows", fused, stored, offset=hidden),
        ]  # fmt: skip
    if layout != "per_expert":
        raise ValueError(f"expert layout {layout!r} is none of {EXPERT_LAYOUTS}")
    module, w1, w3, w2 = _PER_EXPERT[family]
    block = f"model.layers.{index}.{module}"

    def each(kind: str) -> tuple[str, ...]:
        return tuple(f"{block}.experts.{e}.{kind}.weight" for e in range(experts))

    return [
        Source(f"{own}.router.weight", (experts, dim), "whole", (f"{block}.gate.weight",),
               (experts, dim)),
        Source(f"{own}.experts.w1", up, "stacked", each(w1), up[1:]),
        Source(f"{own}.experts.w2", down, "stacked", each(w2), down[1:]),
        Source(f"{own}.experts.w3", up, "stacked", each(w3), up[1:]),
    ]  # fmt: skip
