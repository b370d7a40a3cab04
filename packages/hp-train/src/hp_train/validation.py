"""``--validate``: the tensor-parallel plan run in validation mode against one device before
training (hp-dtensor's equivalence check), raising at the first mismatch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_layout import Mesh
from hp_train.config.schema import ConfigError, ModelConfig, TrainConfig
from hp_train.data.loader import Batch
from hp_train.model.llama import Transformer
from hp_train.parallel.parallelize import Layout3D, tp_plan

__all__ = ["validate_tp_plan"]


def validate_tp_plan(
    model_config: ModelConfig,
    layout: Layout3D,
    global_batches: Sequence[Batch],
    config: TrainConfig,
    device: torch.device,
) -> str:
    """Run the plan of ``layout`` in validation mode on ``global_batches`` (the whole batch
    of each checked step) against one device; the message to print (collective).

    Raises:
        ConfigError: the model or the batch cannot be validated on these ranks.
        AssertionError: the plan's result differs from one device's (hp-dtensor's check).
    """
    from hp_dtensor.parallel.equivalence import assert_equivalent

    if layout.tp_size == 1:
        return "--validate: tp=1, no tensor-parallel plan to validate"
    if model_config.moe is not None:
        raise ConfigError(
            "--validate supports dense models: MoE layers need expert-parallel sharding rules "
            "(hp-dtensor's expert parallelism has not landed)"
        )
    batches = [(whole.inputs.to(device), whole.targets.to(device)) for whole in global_batches]

    def build() -> Transformer:
        return Transformer(model_config).to(device)

    # Validation mode treats every data axis as one (the plan's gradients are Partial over
    # them until reduced): one "dp" axis of all data-parallel ranks, or none. The check is of
    # the tensor-parallel plan, so pipeline ranks join the data axis (whole models there).
    data_ranks = dist.get_world_size() // layout.tp_size
    if config.global_batch % data_ranks:
        raise ConfigError(
            f"--validate runs the whole model on {data_ranks} data-parallel x {layout.tp_size} "
            f"tensor-parallel ranks: global_batch={config.global_batch} must be divisible by "
            f"{data_ranks}"
        )
    if data_ranks > 1:
        mesh = DeviceMesh(device.type, Mesh((data_ranks, layout.tp_size), ("dp", "tp")))
        dp_axes: tuple[str, ...] = ("dp",)
    else:
        mesh = DeviceMesh(device.type, Mesh((layout.tp_size,), ("tp",)))
        dp_axes = ()
    report = assert_equivalent(
        build,
        tp_plan(model_config),
        mesh,
        batches,
        mode="validation",
        tp_axis="tp",
        dp_axes=dp_axes,
        seed=config.seed,
        # Plain SGD between the checked steps: the gradients must agree to rounding, and
        # Adam's division by the root mean square would blow up the rounding of tiny ones.
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return (
        f"--validate: {len(batches)} steps in validation mode match one device (loss error "
        f"{report.loss_error:.2g}, worst gradient {report.grad_error:.2g} at {report.worst_grad})"
    )
