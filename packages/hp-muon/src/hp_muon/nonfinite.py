"""Refusing non-finite gradients before a step changes anything, the same way on every rank.

Newton-Schulz spreads one NaN or inf in a matrix over the whole orthogonalized update, and the
exchange hands that update to every holder of the matrix: a single bad element on one rank
turns whole parameters on several ranks into NaN. So :class:`hp_muon.Muon` looks at every local
gradient before it touches any state and, if one holds a NaN or inf anywhere in the job, every
rank that takes part in the step raises :class:`NonFiniteGradientError` (or skips the step),
naming the same parameter.

Cost: a finite step pays one fused reduction over this rank's gradients
(``torch._foreach_norm``, the 2-norm: NaN or inf whenever an element is, and the fastest fused
reduction torch has on CPU, tens of times faster there than the infinity norm or
``isfinite().all()``) and, where the step is distributed, one 1-element int64
``all_reduce(MIN)`` over the group Muon exchanges over. The reduced value encodes the first
flagged gradient in parameter order and the lowest rank holding a flagged piece of it, so every
rank learns the same answer from that one collective and reads it with one host sync. A 2-norm
also overflows for finite values of about 1e19 and more; so only when something was flagged do
the ranks re-check their flagged gradients element by element and reduce a second time, which
tells a real NaN or inf (refused) from an overflow (stepped as usual).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteGradient",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "find_nonfinite_gradient",
]

NonFinitePolicy = Literal["raise", "skip"]
"""What :class:`hp_muon.Muon` does with a step whose gradients are not all finite."""

NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("raise", "skip")

# Larger than any key (index * world + rank) * 2 + kind of a real optimizer.
_NONE = 2**62


class NonFiniteGradientError(ValueError):
    """A gradient held a NaN or inf; the step was refused before any parameter or optimizer
    state changed. Raised on every rank of the step with the same ``parameter``, ``rank`` and
    ``value``.

    Attributes:
        parameter: the first parameter (in the optimizer's parameter order) whose gradient is
            non-finite on some rank: its name, or ``param_groups[g][i] (shape RxC)`` where the
            optimizer was given no names.
        index: its position among all of the optimizer's parameters (groups in order).
        rank: the lowest (global) rank holding a non-finite piece of its gradient.
        value: ``"nan"`` if that rank's piece holds a NaN, else ``"inf"``.
        local_parameters: every parameter whose gradient is non-finite on *this* rank (empty
            on a rank whose own pieces are all finite).
    """

    def __init__(
        self,
        message: str,
        *,
        parameter: str,
        index: int,
        rank: int,
        value: str,
        local_parameters: tuple[str, ...],
    ) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.index = index
        self.rank = rank
        self.value = value
        self.local_parameters = local_parameters


@dataclass(frozen=True)
class NonFiniteGradient:
    """The first non-finite gradient of a step, as every rank of the check learns it.

    Attributes:
        index: the parameter's position among the checked ones (the caller's numbering).
        rank: the lowest rank holding a non-finite piece of it.
        value: ``"nan"`` (that piece holds a NaN) or ``"inf"``.
        local: the positions whose gradient is non-finite on this rank, in order.
    """

    index: int
    rank: int
    value: Literal["nan", "inf"]
    local: tuple[int, ...]


Grads = Sequence[tuple[int, torch.Tensor]]


def _batches(
    grads: Grads,
) -> dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]]:
    """``grads`` by device and dtype: one ``_foreach_norm`` call (and one stack) each."""
    batches: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for index, grad in grads:
        batches.setdefault((grad.device, grad.dtype), []).append((index, grad))
    return batches


def _key(
    indices: list[int], bad: torch.Tensor, inf: torch.Tensor, rank: int, world: int
) -> torch.Tensor:
    """The smallest ``(index * world + rank) * 2 + kind`` (kind 0 for NaN, 1 for inf) over the
    entries flagged in ``bad``, ``_NONE`` where none is: the minimum over ranks is then the first
    bad parameter, the lowest rank holding a bad piece of it, and NaN where that piece has one."""
    at = torch.tensor(indices, dtype=torch.int64, device=bad.device)
    keys = (at * world + rank) * 2 + inf.to(torch.int64)
    return torch.where(bad, keys, _NONE).min().reshape(1)


def _screen(grads: Grads, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """The key (:func:`_key`) of this rank's first gradient whose 2-norm is not finite, on
    ``device``, without a host sync. Every non-finite gradient is flagged (a NaN or inf element
    makes the norm NaN or inf); a finite one only where its sum of squares overflows."""
    key = torch.full((1,), _NONE, dtype=torch.int64, device=device)
    for (_, dtype), members in _batches(grads).items():
        tensors = [g for _, g in members]
        # An fp16 norm overflows at 65504 (100k elements of about 200, routine for a gradient):
        # take it in fp32 (also the faster kernel on CPU). bf16 has fp32's range.
        if dtype == torch.float16:
            norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        else:
            norms = torch.stack(torch._foreach_norm(tensors, 2))
        flagged = _key(
            [i for i, _ in members], ~torch.isfinite(norms), torch.isinf(norms), rank, world
        )
        key = torch.minimum(key, flagged.to(device))
    return key


def _exact(grads: Grads, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """The key (:func:`_key`) of this rank's first gradient holding a NaN or inf, element by
    element (slower: only for the gradients the screen flagged)."""
    key = torch.full((1,), _NONE, dtype=torch.int64, device=device)
    for members in _batches(grads).values():
        finite = torch.stack([torch.isfinite(g).all() for _, g in members])
        nan = torch.stack([torch.isnan(g).any() for _, g in members])
        flagged = _key([i for i, _ in members], ~finite, ~nan, rank, world)
        key = torch.minimum(key, flagged.to(device))
    return key


def find_nonfinite_gradient(
    grads: Grads, *, group: dist.ProcessGroup | None
) -> NonFiniteGradient | None:
    """The first gradient of ``grads`` that holds a NaN or inf on any rank of ``group``.

    ``grads`` are ``(position, local gradient)`` pairs, the positions numbering the same
    parameters alike on every rank. With a ``group``, this is collective (a 1-element
    ``all_reduce`` over it: every rank of the group must call it, and all get the same answer
    but for :attr:`NonFiniteGradient.local`); without one, it looks at this rank's gradients
    only. Ranks are global ranks.

    A finite step costs one ``_foreach_norm`` (2-norm) per dtype, one all-reduce and one host
    sync. Only where some rank's screen flags a gradient (a real NaN or inf, or finite values
    whose squares overflow) do the ranks re-check their flagged gradients element by element
    and reduce again (every rank saw the same first result, so all take part alike).
    """
    distributed = group is not None and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = grads[0][1].device if grads else torch.device("cpu")

    def reduced(key: torch.Tensor) -> int:
        if distributed:
            with watch("all_reduce (Muon non-finite gradient check)", group):
                dist.all_reduce(key, op=dist.ReduceOp.MIN, group=group)
        return int(key.item())

    if reduced(_screen(grads, rank, world, device)) >= _NONE:
        return None
    # This rank's suspects: a NaN or inf element makes any 2-norm non-finite, so none is missed.
    flagged = [(i, g) for i, g in grads if not bool(torch.isfinite(torch.linalg.vector_norm(g)))]
    found = reduced(_exact(flagged, rank, world, device))
    if found >= _NONE:
        return None  # finite gradients whose 2-norm overflowed
    position, kind = divmod(found, 2)
    local = tuple(i for i, g in flagged if not bool(torch.isfinite(g).all()))
    return NonFiniteGradient(
        index=position // world,
        rank=position % world,
        value="inf" if kind else "nan",
        local=local,
    )
