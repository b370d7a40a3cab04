"""hp-train's models as the planner prices them: :class:`TrainerModel`, an
:class:`hp_planner.price.PricedModel` of a :class:`~hp_train.config.schema.ModelConfig`.

Every answer is the trainer's own: the stage models :func:`hp_train.parallel.job.stage_models`
builds and :func:`hp_train.parallel.pipeline.stage_boundaries` cuts, the styles of
:func:`hp_train.parallel.job.model_parallelism`, the policy of
:func:`hp_train.parallel.job.training_policy` (Muon's optimizer split with the trainer's router
patterns), the fits check :func:`hp_train.parallel.parallelize.check_model_fits` and the refused
pairs of :func:`hp_train.config.combinations.check_combination`, their errors as
:class:`~hp_planner.price.PricingError`. So what the planner prices is what ``python -m
hp_train`` would run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hp_planner import JobDims, ModelParallelism, TrainingPolicy
from hp_planner.price import PricingError, StepShape
from hp_train.config.schema import ConfigError, ModelConfig, TrainConfig
from hp_train.dryrun.refusals import check_runtime_accepts
from hp_train.parallel.job import model_parallelism, stage_models, training_policy
from hp_train.parallel.parallelize import check_model_fits
from hp_train.parallel.pipeline import stage_boundaries

__all__ = ["TrainerModel"]

#: The recipe the priced plans are made for: Muon's optimizer split (nothing else in a recipe
#: changes the FSDP groups, the layouts or the optimizer groups).
_RECIPE = TrainConfig(optimizer="muon")


@dataclass(frozen=True)
class TrainerModel:
    """The trainer's Transformer of ``config``, to price (module doc).

    Attributes:
        config: the model's configuration (its transformer shape, too).
    """

    config: ModelConfig

    @property
    def shape(self) -> ModelConfig:
        """The configuration: it has every attribute a transformer shape names."""
        return self.config

    @property
    def blocks(self) -> str:
        """The Transformer's block list."""
        return "layers"

    @property
    def embedding(self) -> str:
        """The token embedding."""
        return "tok_embeddings"

    @property
    def head(self) -> str:
        """The output head."""
        return "output"

    def stage_models(self, pp: int) -> Sequence[nn.Module]:
        """The trainer's stage models on ``meta``."""
        return stage_models(self.config, pp)

    def stage_boundaries(self, pp: int) -> tuple[int, ...]:
        """Where the trainer cuts the blocks into ``pp`` stages (balanced by parameters)."""
        return stage_boundaries(self.config, pp)

    def parallelism(self, dims: JobDims) -> ModelParallelism:
        """The trainer's styles under ``dims``."""
        return model_parallelism(self.config, dims)

    def policy(self) -> TrainingPolicy:
        """The trainer's policy with Muon's optimizer split."""
        return training_policy(_RECIPE)

    def check_fits(self, dims: JobDims) -> None:
        """The trainer's fits check, as a :class:`~hp_planner.price.PricingError`."""
        try:
            check_model_fits(self.config, dims)
        except ConfigError as exc:
            raise PricingError(str(exc)) from None

    def check_accepts(self, dims: JobDims, step: StepShape) -> None:
        """The trainer's refused pairs, as a :class:`~hp_planner.price.PricingError`."""
        check_runtime_accepts(self.config, dims, step)
