"""``hyper_parallel.core.pipeline_parallel.stage``: upstream's ``PipelineStage(submodule,
stage_index, stage_num, ...)`` as an ``hp_mpmd.PipelineStage``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hp_mpmd
from hp_dtensor import DeviceMesh
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["PipelineStage"]


@adapts("hp_mpmd.PipelineStage", "upstream's `stage_num=`, `mesh=` (a 1-d pipeline sub-mesh)")
class PipelineStage(hp_mpmd.PipelineStage):
    """One pipeline stage's module on this rank (upstream's arguments).

    Args:
        submodule: the stage's layers; takes one tensor, returns one tensor (the last stage
            returns the microbatch's loss: its backward starts from ones, as upstream).
        stage_index: this stage's index in ``[0, stage_num)``.
        stage_num: the number of (virtual) stages.
        device: where received activations and gradients are allocated (default: the
            module's parameters' device).
        group: the pipeline process group (default: ``mesh``'s, else the world).
        mesh: a 1-d pipeline sub-mesh (``mesh["pp"]``) whose group carries the transfers.
        src_stage, dst_stage, dyn_shape, has_backward, shared_parameters: upstream options
            this stack does not offer beyond their defaults (the error says what to use).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        stage_num: int,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        src_stage: int | None = None,
        dst_stage: int | None = None,
        dyn_shape: bool = False,
        has_backward: bool = True,
        shared_parameters: object = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        if src_stage not in (None, stage_index - 1) or dst_stage not in (None, stage_index + 1):
            raise not_offered(
                f"PipelineStage(src_stage={src_stage}, dst_stage={dst_stage})",
                "stage s receives from stage s - 1 and sends to s + 1; place stages on other "
                "ranks with hp_mpmd.StagePlacement",
            )
        if dyn_shape:
            raise not_offered(
                "PipelineStage(dyn_shape=True)",
                "shapes are exchanged once before the first step: keep the microbatch shape "
                "fixed (pad), or build a new schedule for another shape",
            )
        if not has_backward:
            raise not_offered(
                "PipelineStage(has_backward=False)",
                "for a forward-only pass run the stage modules under torch.no_grad()",
            )
        if shared_parameters is not None:
            raise not_offered(
                "PipelineStage(shared_parameters=...)",
                "tie parameters across stages with hp_mpmd.TiedParameter",
            )
        if mesh is not None:
            if group is not None:
                raise ValueError("PipelineStage: pass mesh= or group=, not both")
            if mesh.ndim != 1:
                raise ValueError(
                    f"PipelineStage(mesh=...) needs a 1-d pipeline sub-mesh (mesh['pp']), got "
                    f"{mesh!r}"
                )
            group = mesh.get_group(0)
        super().__init__(submodule, stage_index, stage_num, group=group, device=device)

    @property
    def submodule(self) -> nn.Module:
        """The stage's module (upstream's name for ``module``)."""
        return self.module

    @property
    def stage_num(self) -> int:
        """The number of (virtual) stages (upstream's name for ``num_stages``)."""
        return self.num_stages

    @property
    def is_first_stage(self) -> bool:
        """True for stage 0."""
        return self.is_first

    @property
    def is_last_stage(self) -> bool:
        """True for the last stage."""
        return self.is_last
