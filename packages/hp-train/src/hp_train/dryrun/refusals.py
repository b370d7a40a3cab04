"""The combinations the runtime refuses, refused by the dry run too.

The refusals are the trainer's data (:data:`hp_train.config.combinations.REFUSALS`, checked by
:func:`hp_train.config.combinations.check_combination`); :func:`check_runtime_accepts` states the
dry
run's configuration as the :class:`~hp_train.config.schema.TrainConfig` the trainer would get and
raises the first refused pair as a :class:`hp_planner.price.PricingError`, with the trainer's
message.
"""

from __future__ import annotations

from hp_planner import JobDims
from hp_planner.price import PricingError, StepShape
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ConfigError, ModelConfig, TrainConfig
from hp_train.parallel.virtual import check_virtual_stages_fit

__all__ = ["check_runtime_accepts", "train_config"]


def train_config(parallel: JobDims, shape: StepShape) -> TrainConfig:
    """The trainer's configuration of ``shape`` (its microbatches are the pipeline's with
    ``pp > 1``, its pipeline steps the gradient accumulation; gradient accumulation without).

    Raises:
        PricingError: a value the trainer's configuration refuses.
    """
    pipelined = parallel.pp > 1
    try:
        return TrainConfig(
            global_batch=shape.global_batch,
            seq_len=shape.seq_len,
            optimizer=shape.optimizer,
            microbatches=shape.microbatches if pipelined else 1,
            grad_accum=shape.pipeline_steps if pipelined else shape.microbatches,
            pp_schedule=shape.pp_schedule,
            ac=shape.ac,
            offload=shape.offload,
            mixed_precision="bf16" if shape.precision.compute == 2 else "fp32",
            grad_reduce_dtype="bf16" if shape.precision.reduce == 2 else "fp32",
            fp8=shape.fp8,
            fp8_all_gather=shape.fp8_all_gather,
            swap=shape.swap,
        )
    except ConfigError as exc:
        raise PricingError(str(exc)) from None


def check_runtime_accepts(model: ModelConfig, parallel: JobDims, shape: StepShape) -> None:
    """Raise what the trainer raises for a refused pair of options (module doc).

    Raises:
        PricingError: the first :data:`hp_train.config.combinations.REFUSALS` entry that applies,
            or a pipeline schedule whose stages or microbatches do not fit the model
            (:func:`hp_train.parallel.virtual.check_virtual_stages_fit`).
    """
    try:
        config = train_config(parallel, shape)
        check_combination(model, parallel, config)
        check_virtual_stages_fit(model, parallel, config)
    except PricingError:
        raise
    except ConfigError as exc:
        raise PricingError(str(exc)) from None
