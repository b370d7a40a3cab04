"""What pricing needs to know about a model: its transformer shape and how to plan it.

Pricing a step reads two things of a model:

* its **shape** (:class:`TransformerShape`): the widths, heads and expert counts the FLOPs and
  activation model of :mod:`~hp_planner.price.workload` and :mod:`~hp_planner.price.activation`
  read. Any frozen configuration with these attributes is one (hp-train's ``ModelConfig`` is;
  :class:`TransformerDims` is the planner's own, for a model from elsewhere);
* its **plan** (:class:`PricedModel`): the meta-device model of every pipeline stage and the
  :class:`~hp_planner.ModelParallelism` and :class:`~hp_planner.TrainingPolicy` it is planned
  with, so that :func:`hp_planner.plan_job` makes the :class:`~hp_planner.JobPlan` the pricing
  reads (its FSDP groups, layouts, optimizer groups and Muon step). Nothing here packs a group
  or restates a style's rule.

A trainer implements :class:`PricedModel` for its models (hp-train's
``hp_train.dryrun.TrainerModel``); :class:`MetaModel` implements it for any ``nn.Module`` built
on ``meta`` with a transformer's block list, such as a Hugging Face or torchtitan model.

Blocks are named ``<blocks>.<index>`` (``PricedModel.blocks``), the embedding and the output
head by their module names; the pricing names its FSDP groups and tensor-parallel collectives
by them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import nn

from hp_planner.inputs import JobDims, ModelParallelism, PlanInputError, TrainingPolicy

if TYPE_CHECKING:
    from hp_planner.price.workload import StepShape

__all__ = [
    "TP_SPLITS",
    "MetaModel",
    "MoEDims",
    "MoEShape",
    "PricedModel",
    "PricingError",
    "TransformerDims",
    "TransformerShape",
    "tp_split_problem",
]


class PricingError(PlanInputError):
    """A pricing input that cannot work (the message names it and what would be right)."""


class MoEShape(Protocol):
    """The mixture-of-experts feed-forward of some blocks."""

    @property
    def n_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_ffn_dim(self) -> int: ...
    @property
    def n_shared_experts(self) -> int: ...
    @property
    def aux_loss_weight(self) -> float: ...

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the MoE feed-forward."""
        ...


class TransformerShape(Protocol):
    """A decoder-only transformer with grouped-query attention and SwiGLU feed-forwards."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def moe(self) -> MoEShape | None: ...


@dataclass(frozen=True)
class MoEDims:
    """A :class:`MoEShape` by value: every ``every``-th block (1-based) is MoE;
    ``aux_loss_weight`` > 0 when the loss adds a load-balancing term (its per-call values are
    kept for backward)."""

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    n_shared_experts: int = 0
    every: int = 1
    aux_loss_weight: float = 0.0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the MoE feed-forward."""
        return (index + 1) % self.every == 0


@dataclass(frozen=True)
class TransformerDims:
    """A :class:`TransformerShape` by value (``head_dim`` given, not derived)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    qk_norm: bool = False
    moe: MoEDims | None = None


class PricedModel(Hashable, Protocol):
    """A model the pricing can plan: hashable, because plans are cached per model.

    Attributes:
        shape: its transformer shape.
        blocks: the module holding the blocks (``"layers"``: blocks ``layers.0``, ...).
        embedding: the token embedding's module name.
        head: the output head's module name.
    """

    @property
    def shape(self) -> TransformerShape: ...
    @property
    def blocks(self) -> str: ...
    @property
    def embedding(self) -> str: ...
    @property
    def head(self) -> str: ...

    def stage_models(self, pp: int) -> Sequence[nn.Module]:
        """The model on ``meta``, one per pipeline stage (each keeps its stage's modules)."""
        ...

    def stage_boundaries(self, pp: int) -> tuple[int, ...]:
        """The block indices where the ``pp`` stages start, and the end."""
        ...

    def parallelism(self, dims: JobDims) -> ModelParallelism:
        """Which modules take which style under ``dims``."""
        ...

    def policy(self) -> TrainingPolicy:
        """The training policy of the priced plans, with Muon's optimizer split."""
        ...

    def check_fits(self, dims: JobDims) -> None:
        """Raise :class:`PricingError` where the model cannot be split as ``dims`` asks."""
        ...

    def check_accepts(self, dims: JobDims, step: StepShape) -> None:
        """Raise :class:`PricingError` for a combination the runtime refuses."""
        ...


def _no_refusals(dims: JobDims, step: StepShape) -> None:
    del dims, step


#: The sizes a tensor-parallel degree must divide, and why.
TP_SPLITS = (
    ("n_heads", "tensor parallelism splits attention by whole heads"),
    ("n_kv_heads", "tensor parallelism splits attention by whole heads"),
    ("ffn_dim", "the dense feed-forward's hidden units are split evenly"),
    ("vocab_size", "the embedding and the output head split the vocabulary evenly"),
)


def tp_split_problem(shape: TransformerShape, tp: int) -> str | None:
    """Why ``tp`` cannot split ``shape`` (the first size of :data:`TP_SPLITS` it does not
    divide, why it must, and that size's divisors; ``ffn_dim`` only when some block is
    dense), or None when it splits every one."""
    moe = shape.moe
    dense = moe is None or any(not moe.is_moe_layer(i) for i in range(shape.n_layers))
    for name, why in TP_SPLITS:
        value = getattr(shape, name)
        if value % tp and (name != "ffn_dim" or dense):
            divisors = [str(d) for d in range(1, value + 1) if value % d == 0]
            if len(divisors) > 12:
                divisors = [*divisors[:11], "...", str(value)]
            return (
                f"tp={tp} must divide {name}={value} ({why}); choose tp among its divisors "
                f"{', '.join(divisors)}"
            )
    return None


@dataclass(frozen=True, eq=False)
class MetaModel:
    """A :class:`PricedModel` of one ``nn.Module`` built on ``meta`` by ``build``, not
    pipelined (``pp = 1``: stage cuts are the trainer's, so a pipelined model is a trainer's
    :class:`PricedModel`).

    Attributes:
        shape: its transformer shape.
        build: makes the model on ``meta`` (called once per storage dtype).
        parallelism_for: its styles under given degrees.
        training: the training policy (the optimizer split's patterns).
        blocks: the module holding the blocks.
        embedding: the token embedding's module name.
        head: the output head's module name.
        accepts: raises :class:`PricingError` for what the runtime refuses (nothing: accepts
            everything it can plan).

    Compared by identity: two instances are two models.
    """

    shape: TransformerShape
    build: Callable[[], nn.Module]
    parallelism_for: Callable[[JobDims], ModelParallelism]
    training: TrainingPolicy = field(default_factory=TrainingPolicy)
    blocks: str = "layers"
    embedding: str = "tok_embeddings"
    head: str = "output"
    accepts: Callable[[JobDims, StepShape], None] = _no_refusals

    def stage_models(self, pp: int) -> Sequence[nn.Module]:
        """The one model (raises :class:`PricingError` for ``pp > 1``)."""
        self._one_stage(pp)
        return (self.build(),)

    def stage_boundaries(self, pp: int) -> tuple[int, ...]:
        """``(0, n_layers)`` (raises :class:`PricingError` for ``pp > 1``)."""
        self._one_stage(pp)
        return (0, self.shape.n_layers)

    def parallelism(self, dims: JobDims) -> ModelParallelism:
        """``parallelism_for(dims)``."""
        return self.parallelism_for(dims)

    def policy(self) -> TrainingPolicy:
        """``training``."""
        return self.training

    def check_fits(self, dims: JobDims) -> None:
        """``tp`` divides the heads, the KV heads, the feed-forward and the vocabulary; no
        pipelining."""
        self._one_stage(dims.pp)
        problem = tp_split_problem(self.shape, dims.tp)
        if problem is not None:
            raise PricingError(problem)

    def check_accepts(self, dims: JobDims, step: StepShape) -> None:
        """``accepts(dims, step)``."""
        self.accepts(dims, step)

    @staticmethod
    def _one_stage(pp: int) -> None:
        if pp != 1:
            raise PricingError(
                f"pp={pp}: a MetaModel is one module, not cut into pipeline stages; price a "
                "pipelined model through a PricedModel whose stage_models cuts it"
            )
