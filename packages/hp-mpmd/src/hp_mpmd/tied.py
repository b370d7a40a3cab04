"""Parameters tied across stages on different ranks (e.g. an embedding and the LM head).

Each owning rank holds its own copy of the tied parameter. Single-device training computes one
gradient, the sum of every use's contribution; here each owner's backward produces its own
uses' part, so after the backward :meth:`TiedParameter.reduce_grads` sums the gradients over
the owners. With equal values and equal gradients, every owner's optimizer step keeps the
copies equal; :meth:`TiedParameter.sync_values` broadcasts the first owner's value (at start,
or to repair drift) and :meth:`TiedParameter.max_drift` measures it.

Every rank of the job constructs the same ``TiedParameter``s in the same order (the owners'
process group is created collectively); ranks that own no copy pass ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor.device_mesh import ensure_groups, process_group
from hp_dtensor.watchdog import watch_async

__all__ = ["TiedParameter"]


class TiedParameter:
    """One logical parameter with a copy on each of ``owners`` (global ranks).

    Args:
        param: this rank's copy, or None on ranks outside ``owners``.
        owners: the global ranks holding a copy (at least one; order fixes the source of
            :meth:`sync_values`).
        timeout: the limit for every collective.

    Raises:
        ValueError: ``param`` is given on a rank outside ``owners`` or missing on an owner.
    """

    def __init__(
        self,
        param: nn.Parameter | None,
        owners: Sequence[int],
        *,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        self.owners = tuple(owners)
        if not self.owners or len(set(self.owners)) != len(self.owners):
            raise ValueError(f"owners must be distinct global ranks, got {self.owners}")
        me = dist.get_rank()
        if (me in self.owners) != (param is not None):
            has = "gives" if param is not None else "gives no"
            raise ValueError(
                f"rank {me} {has} copy of the tied parameter but the owners are {self.owners}; "
                "owners pass their copy, other ranks pass None"
            )
        self.param = param
        self.timeout = timeout
        self.group: dist.ProcessGroup | None = None
        if len(self.owners) > 1:
            ensure_groups([self.owners])  # collective over the whole job
            if param is not None:
                self.group = process_group(self.owners)

    def reduce_grads(self) -> None:
        """Sum the owners' gradients (call after the backward, before the optimizer step).
        An owner whose stages did not use the parameter contributes zeros."""
        if self.group is None or self.param is None:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        work = dist.all_reduce(self.param.grad, group=self.group, async_op=True)
        watch_async("all_reduce (tied parameter's gradient)", self.group, work).wait(self.timeout)

    @torch.no_grad()
    def sync_values(self) -> None:
        """Copy the first owner's value to every owner."""
        if self.group is None or self.param is None:
            return
        work = dist.broadcast(self.param.data, src=self.owners[0], group=self.group, async_op=True)
        watch_async("broadcast (tied parameter's value)", self.group, work).wait(self.timeout)

    @torch.no_grad()
    def max_drift(self) -> float:
        """The largest difference between an owner's copy and the first owner's (0 off the
        owners)."""
        if self.group is None or self.param is None:
            return 0.0
        first = self.param.detach().clone()
        work = dist.broadcast(first, src=self.owners[0], group=self.group, async_op=True)
        watch_async("broadcast (tied parameter drift check)", self.group, work).wait(self.timeout)
        drift = (self.param - first).abs().max().reshape(1)
        work = dist.all_reduce(drift, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        watch_async("all_reduce (tied parameter drift check)", self.group, work).wait(self.timeout)
        return float(drift)
