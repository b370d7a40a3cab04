"""FSDP2 names hp-fsdp serves beyond ``fully_shard``, and the ones it refuses, by name.

``torch.distributed.fsdp`` code calls methods on ``FSDPModule`` and a few free functions;
hp-fsdp implements most of them (``hp_fsdp.api.FSDPModule``). The FSDP2 methods it does not
implement are still there, raising ``NotImplementedError`` with what to do instead
(:data:`REFUSED_METHODS`), so code written for FSDP2 fails at the call, naming it, never by a
missing attribute or, worse, silently. ``tests/test_fsdp2_api.py`` checks that every public
method of torch's ``FSDPModule`` is either implemented or refused here, and that the README's
feature table lists each one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hp_fsdp._state import fsdp_state

__all__ = ["REFUSED_METHODS", "UnshardHandle", "refusal", "register_fsdp_forward_method"]

REFUSED_METHODS: dict[str, str] = {
    "set_all_reduce_hook": "a custom HSDP all-reduce hook is not supported (the replicate-axis "
    "reduction is fused across groups; LowPrecisionCommPolicy sets its wire dtype)",
    "set_allocate_memory_from_process_group_for_comm": "process-group-allocated buffers are not "
    "supported; hp-fsdp's collectives work in place on the flat buffers",
    "set_custom_all_gather": "custom all-gather implementations are not supported; "
    "LowPrecisionCommPolicy(param_all_gather_dtype=...) chooses the wire format",
    "set_custom_reduce_scatter": "custom reduce-scatter implementations are not supported; "
    "LowPrecisionCommPolicy(shard_reduce_dtype=...) chooses the wire format",
    "set_post_optim_event": "no cross-stream event is needed: hp-fsdp issues its collectives "
    "on the current stream",
    "set_reduce_scatter_max_input_buffers": "the reduce-scatter inputs are the groups' own "
    "flat gradient buffers (one in flight at a time)",
    "set_reduce_scatter_unused_params": "parameters without gradients reduce zeros in their "
    "group's flat buffer; there is nothing to configure",
    "set_separate_reduce_scatter_group": "a second process group for reduce-scatters is not "
    "supported",
    "set_symm_mem_for_comm": "symmetric-memory collectives are not supported",
    "set_unshard_in_backward": "parameters are always all-gathered again in backward when "
    "resharded after forward (use reshard_after_forward=False to keep them)",
    "reset_iter_state": "hp-fsdp keeps no per-iteration state to reset",
}
"""FSDP2 ``FSDPModule`` methods hp-fsdp refuses, with the reason and the alternative."""


def refusal(name: str, reason: str) -> Callable[..., Any]:
    """A method named ``name`` that raises ``NotImplementedError`` with ``reason``."""

    def refuse(self: object, *args: object, **kwargs: object) -> Any:
        del self, args, kwargs
        raise NotImplementedError(f"FSDPModule.{name} (torch FSDP2) is not implemented: {reason}")

    refuse.__name__ = name
    refuse.__doc__ = f"Not implemented (FSDP2 compatibility): {reason}."
    return refuse


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns, as in FSDP2: :meth:`wait` finishes the
    all-gathers and puts the unsharded parameters on the modules."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait: Callable[[], None] | None = wait

    def wait(self) -> None:
        """Wait for the all-gathers (idempotent)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` run fully_shard's forward hooks like ``forward`` does
    (all-gather before, reshard after), for methods called instead of ``forward`` (e.g.
    ``generate``); FSDP2's function of that name.

    Raises:
        ValueError: ``module`` is not fully_shard'ed, or has no such method.
    """
    state = fsdp_state(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not fully_shard'ed; call fully_shard first")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")

    def with_hooks(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        return state.post_forward(module, args, output)

    with_hooks.__name__ = method_name
    with_hooks.__doc__ = method.__doc__
    object.__setattr__(module, method_name, with_hooks)
