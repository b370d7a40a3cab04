"""What a mixture-of-experts module must offer to be sharded by the expert-parallel styles.

The styles (:class:`~hp_dtensor.parallel.ExpertParallel`,
:class:`~hp_dtensor.parallel.ExpertTensorParallel`) and their dispatch
(:mod:`hp_dtensor.parallel.expert`) do not own a layer: they work on any module with the
structure of :class:`ExpertModule`, the models' own MoE layers (``hp_train.model.moe``) and the
test model (``hp_testing.moe``) alike. The structure is what the dispatch reads to recompute the
module's forward on this rank's shards around its token exchange:

* the gate (``router``), from which :func:`~hp_dtensor.parallel.moe_ops.route` routes tokens;
* the expert stacks (``experts.w1``, ``w2``, ``w3``, ``[E, ...]``), the parameters the styles
  shard (by those names) and :func:`~hp_dtensor.parallel.moe_ops.grouped_swiglu` runs;
* the optional shared experts (a SwiGLU of three ``nn.Linear``), run on every token;
* ``finish``, which attaches the module's auxiliary loss, and ``last_counts``, which the
  dispatch sets to the step's global tokens per expert.

:func:`expert_module_of` checks a module against it when a plan is lowered and names what is
missing, so a wrong module fails at resolution instead of inside a collective.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from hp_dtensor.parallel.moe_ops import ScoreFunc
from hp_dtensor.parallel.plan import PlanError

__all__ = [
    "ExpertModule",
    "ExpertRouter",
    "ExpertStacks",
    "SharedSwiGLU",
    "expert_module_of",
]


class ExpertRouter(Protocol):
    """A token-choice top-k gate, as :func:`~hp_dtensor.parallel.moe_ops.route` takes it."""

    @property
    def weight(self) -> torch.Tensor:
        """``[E, dim]``: the gate (replicated under expert parallelism)."""

    @property
    def top_k(self) -> int:
        """Experts per token."""

    @property
    def score_func(self) -> ScoreFunc:
        """``"softmax"`` or ``"sigmoid"``."""

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """``[E]`` added to the scores for the selection only, or None."""

    @property
    def normalize(self) -> bool:
        """Whether the k combine weights are divided by their sum."""

    @property
    def route_scale(self) -> float:
        """Factor on the combine weights."""


class ExpertStacks(Protocol):
    """``E`` SwiGLU experts as stacks: ``w1``, ``w3`` ``[E, hidden, dim]``, ``w2``
    ``[E, dim, hidden]`` (each matrix ``[out, in]``, as ``nn.Linear``)."""

    @property
    def w1(self) -> torch.Tensor: ...

    @property
    def w2(self) -> torch.Tensor: ...

    @property
    def w3(self) -> torch.Tensor: ...


class SharedSwiGLU(Protocol):
    """A SwiGLU MLP every token goes through: ``w2(silu(w1(x)) * w3(x))``, bias-free."""

    @property
    def w1(self) -> nn.Linear: ...

    @property
    def w2(self) -> nn.Linear: ...

    @property
    def w3(self) -> nn.Linear: ...


class ExpertModule(Protocol):
    """A mixture-of-experts module the expert-parallel styles can shard.

    Its single-device forward must be, for tokens ``x`` ``[..., dim]`` flattened to ``[T, dim]``:
    ``route`` with the router's settings, ``sort_by_expert``, ``grouped_swiglu`` on the
    stacks, ``combine``, plus the shared experts' SwiGLU if any, then ``finish`` with the
    routing's scores and counts and ``T`` (all from :mod:`hp_dtensor.parallel.moe_ops`), and
    set ``last_counts`` to the counts: the dispatch computes exactly that with the experts
    spread over ranks.
    """

    last_counts: torch.Tensor | None

    @property
    def dim(self) -> int:
        """Token features."""

    @property
    def num_experts(self) -> int:
        """Routed experts ``E`` (over all ranks)."""

    @property
    def top_k(self) -> int:
        """Experts per token."""

    @property
    def router(self) -> ExpertRouter: ...

    @property
    def experts(self) -> ExpertStacks: ...

    @property
    def shared(self) -> SharedSwiGLU | None: ...

    def finish(
        self,
        out: torch.Tensor,
        scores: torch.Tensor,
        counts: torch.Tensor,
        num_tokens: int,
        *,
        aux_grad: float = 1.0,
    ) -> torch.Tensor:
        """``out`` with the auxiliary loss attached (``counts`` and ``num_tokens`` over all
        tokens, ``scores`` this rank's rows, gradient seed ``aux_grad``)."""


_REQUIRED = (
    "dim",
    "num_experts",
    "top_k",
    "last_counts",
    "finish",
    "router.weight",
    "router.top_k",
    "router.score_func",
    "router.expert_bias",
    "router.normalize",
    "router.route_scale",
    "experts.w1",
    "experts.w2",
    "experts.w3",
    "shared",
)
_SHARED = ("shared.w1.weight", "shared.w2.weight", "shared.w3.weight")


def _has(obj: object, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def expert_module_of(module: nn.Module, style: str, name: str) -> ExpertModule:
    """``module`` as an :class:`ExpertModule`, checked (attribute by attribute).

    Raises:
        PlanError: naming the style, the module and every attribute it lacks.
    """
    missing = [path for path in _REQUIRED if not _has(module, path)]
    if not missing and getattr(module, "shared", None) is not None:
        missing = [path for path in _SHARED if not _has(module, path)]
    if missing:
        raise PlanError(
            f"{style} cannot shard module {name!r} ({type(module).__name__}); it needs a "
            "mixture-of-experts module with the structure of hp_dtensor.parallel.ExpertModule "
            f"(router, expert stacks, optional shared experts, finish), which lacks: "
            f"{', '.join(missing)}"
        )
    return cast(ExpertModule, module)
