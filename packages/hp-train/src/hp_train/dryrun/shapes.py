"""The parameters a run shards, from the model built on ``meta``: shapes, tensor-parallel
placement, optimizer, and the FSDP groups as flat-buffer layouts.

Nothing is allocated: :func:`model_parameters` builds :class:`hp_train.model.Transformer` under
``torch.device("meta")`` (shapes only) and splits the parameters between Muon and AdamW with
:func:`hp_muon.split_params` (the rule the training loop uses).

Tensor parallelism follows ``hp_dtensor.parallel.transformer_tp_plan`` (Megatron):
``tok_embeddings`` row-wise (vocabulary, dim 0), ``q/k/v_proj`` and ``ffn.w1/w3`` column-wise
(dim 0), ``o_proj`` and ``ffn.w2`` row-wise (dim 1), ``output`` column-wise (dim 0); norms and
the MoE router are replicated. MoE experts are *modeled* the Megatron way per expert
(``w1``/``w3`` ``[E, ffn, dim]`` on dim 1, ``w2`` ``[E, dim, ffn]`` on dim 2, shared experts
like a dense feed-forward); the runtime's plan does not cover MoE layers yet.

FSDP follows ``hp_fsdp``: one ``fully_shard`` per block, then the root with the remaining
parameters (``tok_embeddings``, ``norm``, ``output``). Each group packs its parameters' local
(tensor-parallel) shapes with :func:`hp_layout.plan_flat_buffer` into ``dp_shard`` chunks,
aligned to 16 bytes of the storage dtype, parameters replicated over a tensor-parallel axis
of size > 1 last (their gradients need an extra all-reduce of the buffer's tail).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from hp_layout import FlatBufferLayout, chunk_length, plan_flat_buffer
from hp_muon import split_params
from hp_train.config import ModelConfig
from hp_train.dryrun.presets import DryRunError
from hp_train.model import Transformer

__all__ = [
    "GroupSpec",
    "ParamSpec",
    "check_tp",
    "fsdp_groups",
    "model_parameters",
    "parameter_count",
    "tp_dim",
]

_ALIGN_BYTES = 16


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model.

    Attributes:
        name: its fully qualified name (``layers.3.attn.q_proj.weight``).
        shape: its global shape.
        optimizer: ``"muon"`` or ``"adamw"`` (by :func:`hp_muon.split_params`).
        tp_dim: the dim tensor parallelism shards, or None when replicated over it.
    """

    name: str
    shape: tuple[int, ...]
    optimizer: str
    tp_dim: int | None

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def local_shape(self, tp: int, coordinate: int = 0) -> tuple[int, ...]:
        """Its shape on tensor-parallel coordinate ``coordinate`` of ``tp`` (chunk semantics)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        dims = list(self.shape)
        dims[self.tp_dim] = chunk_length(dims[self.tp_dim], tp, coordinate)
        return tuple(dims)


_TP_RULES: tuple[tuple[str, int], ...] = (
    (r"tok_embeddings\.weight", 0),
    (r"layers\.\d+\.attn\.[qkv]_proj\.weight", 0),
    (r"layers\.\d+\.attn\.o_proj\.weight", 1),
    (r"layers\.\d+\.ffn\.(shared\.)?w[13]\.weight", 0),
    (r"layers\.\d+\.ffn\.(shared\.)?w2\.weight", 1),
    (r"layers\.\d+\.ffn\.experts\.w[13]", 1),
    (r"layers\.\d+\.ffn\.experts\.w2", 2),
    (r"output\.weight", 0),
)


def tp_dim(name: str) -> int | None:
    """The dim the Megatron plan shards parameter ``name`` on (None: replicated)."""
    for pattern, dim in _TP_RULES:
        if re.fullmatch(pattern, name):
            return dim
    return None


@lru_cache(maxsize=32)
def model_parameters(model: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every trainable parameter of :class:`~hp_train.model.Transformer` built from ``model``,
    in ``named_parameters`` order.

    Postconditions: the shapes are those of the real module (built on ``meta``: no memory);
    each parameter is tagged with its optimizer and tensor-parallel dim.
    """
    with torch.device("meta"):
        module = Transformer(model)
    split = split_params(module)
    muon = {name for name, _ in split.muon}
    return tuple(
        ParamSpec(name, tuple(p.shape), "muon" if name in muon else "adamw", tp_dim(name))
        for name, p in module.named_parameters()
        if p.requires_grad
    )


def parameter_count(model: ModelConfig) -> int:
    """Total parameters of the model (from the meta model)."""
    return sum(p.numel for p in model_parameters(model))


def check_tp(model: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the attention cannot be split by.

    Raises:
        DryRunError: ``tp`` does not divide ``n_heads`` or ``n_kv_heads``.
    """
    for field in ("n_heads", "n_kv_heads"):
        heads = getattr(model, field)
        if heads % tp:
            raise DryRunError(
                f"tp={tp} does not divide {field}={heads}: tensor parallelism splits attention "
                f"by whole heads; choose tp among the divisors of {heads}"
            )


@dataclass(frozen=True)
class GroupSpec:
    """One FSDP group (one ``fully_shard`` call) on one tensor-parallel coordinate.

    Attributes:
        name: ``"layers.N"`` for a block, ``"root"`` for the root.
        params: its parameters in flat-buffer order.
        local_shapes: each parameter's tensor-parallel local shape (what is packed).
        flat: the packing (``dp_shard`` chunks).
        extra_start: first element of the tail that is all-reduced over the tensor-parallel
            axis before the reduce-scatter (``flat.padded_numel`` when there is none).
    """

    name: str
    params: tuple[ParamSpec, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    flat: FlatBufferLayout
    extra_start: int

    @property
    def is_root(self) -> bool:
        """Whether this is the root's group (kept unsharded from forward to backward)."""
        return self.name == "root"

    def local_numels(self, coordinate: int) -> tuple[int, ...]:
        """Elements of each parameter in chunk ``coordinate`` (this rank's pieces)."""
        out = [0] * len(self.params)
        for span in self.flat.spans(coordinate):
            out[span.index] += span.stop - span.start
        return tuple(out)


@lru_cache(maxsize=4096)
def _plan(shapes: tuple[tuple[int, ...], ...], shards: int, align: int) -> FlatBufferLayout:
    return plan_flat_buffer(shapes, shards, align)


def _group(
    name: str, params: list[ParamSpec], dp_shard: int, tp: int, coordinate: int, param_bytes: int
) -> GroupSpec:
    if tp > 1:
        plain = [p for p in params if p.tp_dim is not None]
        extra = [p for p in params if p.tp_dim is None]
        params = plain + extra
    else:
        extra = []
    shapes = tuple(p.local_shape(tp, coordinate) for p in params)
    align = max(1, _ALIGN_BYTES // param_bytes)
    flat = _plan(shapes, dp_shard, align)
    start = flat.slots[len(params) - len(extra)].offset if extra else flat.padded_numel
    return GroupSpec(name, tuple(params), shapes, flat, start)


@lru_cache(maxsize=256)
def fsdp_groups(
    model: ModelConfig,
    dp_shard: int,
    tp: int,
    *,
    tp_coordinate: int = 0,
    param_bytes: int = 4,
    layers: tuple[int, int] | None = None,
    embedding: bool = True,
    head: bool = True,
) -> tuple[GroupSpec, ...]:
    """The FSDP groups in ``fully_shard`` order: one per block of ``layers`` (``[start, stop)``, all
    by default), then the root with ``tok_embeddings`` (if ``embedding``) and ``norm`` and
    ``output`` (if ``head``), as one pipeline stage holds them.

    Postconditions: every listed parameter is in exactly one group; each group's ``flat`` is
    ``hp_layout.plan_flat_buffer`` of its local shapes over ``dp_shard`` chunks with hp_fsdp's
    alignment (16 bytes of ``param_bytes``); a root with no parameters is omitted.

    Raises:
        DryRunError: ``tp`` does not divide the heads.
    """
    check_tp(model, tp)
    start, stop = layers if layers is not None else (0, model.n_layers)
    by_block: dict[int, list[ParamSpec]] = {}
    root: list[ParamSpec] = []
    for p in model_parameters(model):
        match = re.match(r"layers\.(\d+)\.", p.name)
        if match:
            by_block.setdefault(int(match.group(1)), []).append(p)
        elif (p.name.startswith("tok_embeddings.") and embedding) or (
            not p.name.startswith("tok_embeddings.") and head
        ):
            root.append(p)
    groups = [
        _group(f"layers.{i}", by_block[i], dp_shard, tp, tp_coordinate, param_bytes)
        for i in range(start, stop)
    ]
    if root:
        groups.append(_group("root", root, dp_shard, tp, tp_coordinate, param_bytes))
    return tuple(groups)
