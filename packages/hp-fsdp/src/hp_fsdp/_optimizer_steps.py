"""How many torch optimizer steps this process has run: the second half of the key of a cache
of values computed from the parameters (the FP8 all-gather's quantized shard).

A tensor's version counter alone does not prove it unchanged. torch 2.13 does not bump it for
an in-place ``torch._foreach_*`` op (what ``Adam(W)``, ``SGD`` and others run with
``foreach=True``, their default on CUDA) when any ``TorchDispatchMode`` is active (a profiler's,
a FLOP counter's, hp-fsdp's :class:`~hp_fsdp.counting.CountingMode`), nor for any in-place op on
a ``torch.distributed.tensor.DTensor`` whose local tensor views another buffer. A cache keyed on
the version alone then serves the previous step's values for the rest of training.

Every :class:`torch.optim.Optimizer` calls the global step post hooks after its ``step``
(:func:`torch.optim.optimizer.register_optimizer_step_post_hook`); one hook, registered the first
time :func:`optimizer_steps` is called, counts them. A cache keyed on ``(version, steps)`` is
dropped after every optimizer step whatever the op or the mode, and still after an in-place
write outside an optimizer that bumps the version (``load_state_dict``, ``param.copy_``).
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["optimizer_steps"]

_steps = 0
_registered = False


def _count(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _steps
    _steps += 1


def optimizer_steps() -> int:
    """The number of ``torch.optim.Optimizer.step`` calls completed in this process since the
    first call of this function (which starts the count)."""
    global _registered
    if not _registered:
        register_optimizer_step_post_hook(_count)
        _registered = True
    return _steps
