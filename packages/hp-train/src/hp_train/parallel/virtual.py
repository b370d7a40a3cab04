"""Virtual pipeline stages: one pipeline rank running several stages of the model.

Interleaved 1F1B and DualPipeV cut the model into ``pp x v`` stages and give each pipeline rank
``v`` of them (interleaved: stages ``r, r + pp, ...``; DualPipeV: ``r`` and ``2 pp - 1 - r``),
as the schedule's plan places them (``SchedulePlan.stage_to_rank``). Each rank builds one
Transformer keeping the blocks of all its stages under their global names (``layers.<i>``),
the embedding where it runs stage 0 and the final norm and head where it runs the last stage,
so checkpoints and plans name every parameter as in the whole model, and FSDP shards it as
today (every block, then the root).

The runtime needs one module per stage: a :class:`StageView` runs its stage's part of the
rank's :class:`StagedTransformer` *through the root's call* (``root(x, part=...)``), so the
root's forward hooks run for every stage (FSDP's lazy initialization, the root's
unshard, the pre-backward hooks on the stage's output), then only that stage's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hp_planner import JobDims
from hp_train.config.schema import ConfigError, ModelConfig, TrainConfig
from hp_train.model.llama import Transformer

__all__ = [
    "StagePart",
    "StageView",
    "StagedTransformer",
    "check_virtual_stages_fit",
    "keep_stages",
    "stage_parts",
]


def check_virtual_stages_fit(model: ModelConfig, parallel: JobDims, config: TrainConfig) -> None:
    """Refuse a pipeline whose ``pp x virtual_stages`` stages do not split the blocks evenly
    (with more than one stage per rank) or whose microbatch count the schedule cannot run.

    Raises:
        ConfigError: naming the counts that would work.
    """
    if parallel.pp == 1:
        return
    v, pp, blocks = config.virtual_stages, parallel.pp, model.n_layers
    if v > 1 and blocks % (pp * v):
        fits = [k for k in range(1, blocks // pp + 1) if blocks % (pp * k) == 0]
        fix = (
            f"with pp={pp} use pp_virtual_stages in {fits}"
            if config.pp_schedule == "interleaved"
            else f"{config.pp_schedule} runs {v} stages per rank: use n_layers a multiple of "
            f"{pp * v}"
        )
        raise ConfigError(
            f"pp_virtual_stages={v}: {config.pp_schedule} cuts the model into pp x "
            f"pp_virtual_stages = {pp * v} stages, which must divide its n_layers={blocks}; " + fix
        )
    m = config.microbatches
    if config.pp_schedule == "interleaved" and m % pp:
        lower, upper = m // pp * pp, (m // pp + 1) * pp
        hint = f"{lower} or {upper}" if lower else str(upper)
        raise ConfigError(
            f"microbatches={m}: the interleaved schedule runs microbatches in groups of pp={pp}; "
            f"use a multiple of {pp} ({hint})"
        )
    if config.pp_schedule == "dualpipev" and m < 2 * pp:
        raise ConfigError(
            f"microbatches={m}: dualpipev needs at least 2 x pp = {2 * pp} microbatches "
            f"(its warm-up runs {2 * pp - 1} forwards on the first rank); use {2 * pp} or more"
        )


def keep_stages(
    model: Transformer, stages: Sequence[int], boundaries: Sequence[int]
) -> Transformer:
    """Drop from ``model`` (in place) everything ``stages`` do not run: stage ``s`` runs the
    blocks ``boundaries[s] <= i < boundaries[s + 1]``, stage 0 the embedding, the last stage
    (``len(boundaries) - 2``) the final norm and the head. Returns ``model``."""
    last = len(boundaries) - 2
    held = {i for s in stages for i in range(boundaries[s], boundaries[s + 1])}
    for key in list(model.layers.keys()):
        if int(key) not in held:
            del model.layers[key]
    if 0 not in stages:
        model.tok_embeddings = None
    if last not in stages:
        model.norm = None
        model.output = None
    return model


@dataclass(frozen=True)
class StagePart:
    """What one stage runs of its rank's model.

    Attributes:
        index: the stage.
        blocks: the keys of its blocks in ``model.layers``, in order.
        embed: it starts with the embedding (stage 0).
        head: it ends with the final norm and the head (the last stage).
    """

    index: int
    blocks: tuple[str, ...]
    embed: bool
    head: bool


def stage_parts(stages: Sequence[int], boundaries: Sequence[int]) -> list[StagePart]:
    """The :class:`StagePart` of each of ``stages`` (cut at ``boundaries``), in order."""
    last = len(boundaries) - 2
    return [
        StagePart(
            s, tuple(str(i) for i in range(boundaries[s], boundaries[s + 1])), s == 0, s == last
        )
        for s in stages
    ]


class StagedTransformer(Transformer):
    """A :class:`Transformer` that can run one stage's part of itself: ``model(x, part=p)``
    runs the embedding if ``p.embed``, the blocks ``p.blocks``, the final norm and the head
    if ``p.head``; without ``part``, the Transformer's forward. The same parameters, names
    and initialization as a Transformer of the same config."""

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        part: StagePart | None = None,
    ) -> torch.Tensor:
        """The Transformer's forward, or (``part``) that stage's part of it (class docstring).

        Raises:
            ValueError: a sequence or a position past ``max_seq_len``.
            KeyError: ``part`` names a block this model does not keep.
        """
        if part is None:
            return super().forward(ids, positions)
        seq = ids.shape[1]
        # Context parallelism's global column positions, as the Transformer's forward takes
        # them when it has them (a stage's input carries hidden states only).
        column_positions = getattr(self, "column_positions", None)
        if positions is None and column_positions is not None:
            positions = column_positions(seq)
        reach = seq if positions is None else int(positions.max()) + 1 if seq else 0
        if reach > self.config.max_seq_len:
            raise ValueError(
                f"sequence positions up to {reach - 1} exceed max_seq_len {self.config.max_seq_len}"
            )
        table = slice(0, seq) if positions is None else positions
        cos, sin = self.cos[table], self.sin[table]
        x = ids
        if part.embed:
            assert self.tok_embeddings is not None, "stage 0's rank keeps the embedding"
            x = self.tok_embeddings(ids)
        for key in part.blocks:
            x = self.layers[key](x, cos, sin)
        if part.head:
            assert self.norm is not None, "the last stage's rank keeps the final norm"
            assert self.output is not None, "the last stage's rank keeps the head"
            x = self.output(self.norm(x))
        return x


class StageView(nn.Module):
    """One stage of a rank's :class:`StagedTransformer`, as a pipeline stage's module.

    ``view(x)`` is ``root(x, part=part)``: the root's call, so the root's hooks (FSDP's) run
    for each stage. The view registers no parameter or module of its own (the root owns them
    all; a registered copy would name them twice): :attr:`root` reaches the model.
    """

    def __init__(self, root: StagedTransformer, part: StagePart) -> None:
        super().__init__()
        self._root = (root,)  # a tuple: nn.Module would register a module attribute
        self.part = part

    @property
    def root(self) -> StagedTransformer:
        """The rank's model."""
        return self._root[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's part of the root on ``x`` (token ids for stage 0, hidden states after)."""
        out: torch.Tensor = self.root(x, part=self.part)
        return out

    def extra_repr(self) -> str:
        p = self.part
        blocks = f"blocks {p.blocks[0]}..{p.blocks[-1]}" if p.blocks else "no blocks"
        return f"stage {p.index}: {'embedding, ' if p.embed else ''}{blocks}" + (
            ", norm and head" if p.head else ""
        )
