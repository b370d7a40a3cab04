"""Activation checkpointing with per-op policies: save, swap to host, or recompute.

:func:`checkpoint_wrapper` wraps a module in place: its forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)``. The contexts
are torch's selective-checkpoint pair (``create_selective_checkpoint_contexts``) driven by the
policy, with, when the policy swaps ops, a dispatch mode of this package *below* torch's:

* forward: torch's caching mode runs each op; for an op the policy saves it caches the output
  (``CheckpointPolicy.MUST_SAVE``); for an op the policy swaps, the mode below copies the output
  into a host buffer of the :class:`~hp_offload.swap.Swapper` and torch marks it recomputed;
* recompute (in backward): torch returns cached outputs; for a swapped op it "recomputes", and
  the mode below answers with the tensor fetched back from host instead of running the op
  (fetches are started when the layer's backward starts, one layer ahead: see
  :mod:`hp_offload.swap`). Everything else is recomputed.

The wrapper uses module ``forward`` replacement only (``module.__call__`` and its hooks, FSDP's
or TP's, run as usual around it; recomputation calls the original ``forward`` again, so
collectives in forward run again in backward, on every rank alike). Random ops recompute
bit-equal (torch's RNG state is stashed and restored).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts as _sac_contexts

import hp_offload.memory as memory
from hp_offload.policy import (
    FULL_RECOMPUTE,
    Action,
    ActivationPolicy,
    BudgetPolicy,
    aliasing,
    factory,
    op_cost,
    out_bytes,
    signature,
)
from hp_offload.swap import SwapGroup, SwappedTensor, Swapper, mark_wrapped

__all__ = ["checkpoint_wrapper"]

Policy = ActivationPolicy | BudgetPolicy


def _flat(out: object) -> list[object]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _SwapForwardMode(TorchDispatchMode):
    """Below torch's caching mode in forward: offloads the outputs of ops the policy swaps."""

    def __init__(self, region: _Region) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.region = region

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        region = self.region
        if region.swap_candidate(func) and region.decide(func, args, out) == "swap":
            region.store_swap(func, out)
        return out


class _SwapReplayMode(TorchDispatchMode):
    """Below torch's cached mode in recompute: answers swapped ops with the fetched tensors."""

    def __init__(self, region: _Region) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.region = region

    def __enter__(self) -> _SwapReplayMode:
        self.region.replay_counter.clear()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        region = self.region
        if not region.swap_candidate(func):
            return func(*args, **(kwargs or {}))
        return region.replay(func, args, kwargs or {})


#: Operator namespaces of collectives (c10d's in-place ops and the functional ones).
_COLLECTIVE_NAMESPACES: frozenset[str] = frozenset(("c10d", "_c10d_functional", "c10d_functional"))


class _CollectivesUncached(TorchDispatchMode):
    """One of torch's selective-checkpoint modes, except that collectives go past it.

    torch's modes match an op's recompute call to its forward call by counting the calls of
    each op. Collectives break that count: FSDP's all-gathers and prefetches run inside a
    region from the hooks of modules nested in it, and which of them a call issues differs
    between forward and recompute (the first step has no prefetch order yet; in backward a
    group is unsharded that was not in forward). A collective is never cached (it is in place
    or its output is a communication buffer), so it simply runs in recompute, as under full
    recomputation, on every rank alike; the other ops keep torch's caching and counting.
    Holds the torch mode instead of stacking it, and forwards every other op to it.

    In forward, a collective that reduces an output the policy saved in place raises:
    torch's cache holds that output by reference and does not see a collective's write, so
    recompute would apply the collective a second time to the cached result. The mode's
    ``holds_op_outputs`` attribute (true in forward) tells libraries to reduce out of place.
    """

    def __init__(self, sac_mode: TorchDispatchMode, region: _Region | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sac_mode = sac_mode
        self.region = region
        # Read by libraries that would otherwise reduce an op's output in place (hp-dtensor's
        # tensor-parallel sum): in forward, the cache holds saved outputs by reference.
        self.holds_op_outputs = region is not None

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            if self.region is not None and self.region.saved_storages:
                self.region.check_not_saved(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
        return self.sac_mode.__torch_dispatch__(func, types, args, kwargs)


#: c10d's in-place reductions: they add into their ``tensors`` argument, so a second
#: application changes the result (an all-gather, all-to-all or broadcast that writes its
#: output again writes the same values).
_IN_PLACE_REDUCTIONS: frozenset[str] = frozenset(
    ("c10d::allreduce_", "c10d::allreduce_coalesced_", "c10d::reduce_")
)


def _reduced_in_place(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors the collective ``func`` reduces in place (none for other collectives).
    c10d's schemas do not mark their writes, which is also why autograd's version counters
    (and torch's check of cached outputs) miss them."""
    if func._schema.name not in _IN_PLACE_REDUCTIONS:
        return []
    value = args[0] if args else kwargs.get("tensors")
    items = value if isinstance(value, (list, tuple)) else [value]
    return [item for item in items if isinstance(item, torch.Tensor)]


class _Region:
    """State of one checkpointed call of a wrapped layer (one set of contexts)."""

    def __init__(self, wrapper: _Wrapper, group: SwapGroup | None) -> None:
        self.wrapper = wrapper
        self.policy = wrapper.policy
        self.group = group
        self.save_tokens: list[memory.Token] = []
        self.swapped: dict[
            torch._ops.OpOverload,
            dict[int, tuple[bool, list[SwappedTensor | tuple[object, memory.Token | None]]]],
        ] = defaultdict(dict)
        self.fwd_counter: dict[torch._ops.OpOverload, int] = defaultdict(int)
        self.replay_counter: dict[torch._ops.OpOverload, int] = defaultdict(int)
        self.ops: list[tuple[torch._ops.OpOverload, float, int]] = []
        self.plan: frozenset[int] | None = None
        # The planned call's op sequence; a call that departs from it saves nothing after.
        self.plan_ops: tuple[torch._ops.OpOverload, ...] = ()
        self.departed = False
        self.saved_bytes = 0
        self.outputs_at: dict[int, list[int]] = {}
        self.n_ops = 0
        # Storages of the outputs torch's cache holds for recompute (alive until then).
        self.saved_storages: set[int] = set()

    # ---- decisions ----------------------------------------------------------------------

    def swap_candidate(self, func: torch._ops.OpOverload) -> bool:
        """Whether the policy may swap ``func`` (a function of the op alone)."""
        return self.group is not None and self.wrapper.may_swap(func)

    def decide(self, func: torch._ops.OpOverload, args: tuple[Any, ...], out: object) -> Action:
        """The action for one forward call (ActivationPolicy only): the policy's, except that
        views, in-place ops and factories (no tensor argument) are always recomputed."""
        assert isinstance(self.policy, ActivationPolicy)
        if self.wrapper.always_recompute(func) or factory(func, args):
            return "recompute"
        return self.policy.action(func, out)

    def policy_fn(
        self,
        ctx: SelectiveCheckpointContext,
        func: torch._ops.OpOverload,
        *args: Any,
        **kwargs: Any,
    ) -> CheckpointPolicy:
        """torch's SAC policy function (called once per op in forward)."""
        out = ctx.op_output
        if isinstance(self.policy, BudgetPolicy):
            index = self.n_ops
            self.n_ops += 1
            if self.plan is None:  # first call of this signature: record, recompute all
                self.record(index, func, args, out)
                return CheckpointPolicy.PREFER_RECOMPUTE
            save = index in self.plan and self.follows_plan(index, func) and self.fits(out)
        else:
            save = self.decide(func, args, out) == "save"
        if not save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        for t in _flat(out):
            if isinstance(t, torch.Tensor):
                self.saved_storages.add(t.untyped_storage().data_ptr())
                token = memory.track(t, "device")
                if token is not None:
                    self.save_tokens.append(token)
        return CheckpointPolicy.MUST_SAVE

    def check_not_saved(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Raise if the collective ``func`` reduces a saved output in place (forward only)."""
        for t in _reduced_in_place(func, args, kwargs):
            if t.untyped_storage().data_ptr() in self.saved_storages:
                raise RuntimeError(
                    f"{type(self.wrapper.module).__name__}: collective {func} reduces in place "
                    f"a tensor that the activation policy saved for recompute "
                    f"({tuple(t.shape)}, {t.dtype}); the saved copy would be reduced twice in "
                    "backward. Reduce out of place (into a new tensor), or let the policy "
                    "recompute that op"
                )

    def follows_plan(self, index: int, func: torch._ops.OpOverload) -> bool:
        """Whether this call's ops so far are the plan's (a layer with data-dependent control
        flow, such as an expert-parallel MoE, may run other ops for the same input shapes)."""
        if not self.departed and (index >= len(self.plan_ops) or self.plan_ops[index] != func):
            self.departed = True
        return not self.departed

    def fits(self, out: object) -> bool:
        """Whether ``out`` still fits this call's budget (sizes can be data-dependent too)."""
        assert isinstance(self.policy, BudgetPolicy)
        nbytes = out_bytes(out)
        if self.saved_bytes + nbytes > self.policy.budget_bytes:
            return False
        self.saved_bytes += nbytes
        return True

    def record(
        self, index: int, func: torch._ops.OpOverload, args: tuple[Any, ...], out: object
    ) -> None:
        """Calibration of a BudgetPolicy: the op's cost and bytes; an earlier output that this
        op mutates gets cost 0 (it must not be cached)."""
        if func._schema.is_mutable:
            for a in args:
                if isinstance(a, torch.Tensor):
                    for i in self.outputs_at.get(a.untyped_storage().data_ptr(), ()):
                        self.ops[i] = (self.ops[i][0], 0.0, self.ops[i][2])
        cost = 0.0 if factory(func, args) else op_cost(func, args, out)
        self.ops.append((func, cost, out_bytes(out)))
        for t in _flat(out):
            if isinstance(t, torch.Tensor):
                self.outputs_at.setdefault(t.untyped_storage().data_ptr(), []).append(index)

    # ---- swap ---------------------------------------------------------------------------

    def store_swap(self, func: torch._ops.OpOverload, out: object) -> None:
        """Offload the tensor outputs of one swapped op call (forward)."""
        assert self.group is not None
        sw = self.wrapper.swapper
        assert sw is not None
        entries: list[SwappedTensor | tuple[object, memory.Token | None]] = []
        for t in _flat(out):
            if (
                isinstance(t, torch.Tensor)
                and t.device == sw.device
                and t.numel() * t.element_size() >= max(sw.min_bytes, 1)
            ):
                entries.append(sw.offload(t, self.group))
            else:  # kept as is (tiny, not dense, not a tensor)
                token = memory.track(t, "device") if isinstance(t, torch.Tensor) else None
                entries.append((t, token))
        index = self.fwd_counter[func]
        self.fwd_counter[func] += 1
        self.swapped[func][index] = (isinstance(out, (tuple, list)), entries)

    def replay(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The output of a swap-candidate op in recompute: fetched, or run if not swapped."""
        index = self.replay_counter[func]
        self.replay_counter[func] += 1
        entries = self.swapped[func].pop(index, None)
        if entries is None:  # decided "recompute" in forward
            return func(*args, **kwargs)
        sw = self.wrapper.swapper
        assert sw is not None
        is_seq, items = entries
        values = [sw.get(e) if isinstance(e, SwappedTensor) else e[0] for e in items]
        return tuple(values) if is_seq else values[0]

    # ---- contexts -----------------------------------------------------------------------

    def contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        """``context_fn`` for torch's checkpoint: (forward context, recompute context)."""
        if self.policy == FULL_RECOMPUTE:  # nothing to cache: no dispatch modes at all
            return contextlib.nullcontext(), contextlib.nullcontext()
        torch_caching, torch_cached = _sac_contexts(self.policy_fn)
        caching = _CollectivesUncached(torch_caching, self)
        cached = _CollectivesUncached(torch_cached)
        if self.group is None:
            fwd: list[contextlib.AbstractContextManager[Any]] = [caching]
            rec: list[contextlib.AbstractContextManager[Any]] = [cached]
        else:
            fwd = [_SwapForwardMode(self), caching]
            rec = [_SwapReplayMode(self), cached]
        return _Chain(fwd), _Chain(rec, on_exit=self.release_save_tokens)

    def release_save_tokens(self) -> None:
        """Stop counting the cached outputs (recompute consumed them)."""
        for token in self.save_tokens:
            token.release()
        self.save_tokens.clear()


class _Chain(contextlib.AbstractContextManager[Any]):
    """Enter context managers in order (the last one on top), exit in reverse."""

    def __init__(
        self, managers: list[contextlib.AbstractContextManager[Any]], on_exit: Any = None
    ) -> None:
        self.managers = managers
        self.on_exit = on_exit
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> _Chain:
        stack = contextlib.ExitStack()
        for m in self.managers:
            stack.enter_context(m)
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        try:
            return stack.__exit__(*exc)
        finally:
            if self.on_exit is not None:
                self.on_exit()


class _Wrapper:
    """The per-module state of a checkpoint wrapper."""

    def __init__(
        self, module: nn.Module, policy: Policy, swapper: Swapper | None, preserve_rng_state: bool
    ) -> None:
        self.module = module
        self.policy = policy
        self.swapper = swapper
        self.preserve_rng_state = preserve_rng_state
        self.original = module.forward
        self.plans: dict[
            tuple[object, ...], tuple[frozenset[int], tuple[torch._ops.OpOverload, ...]]
        ] = {}
        self._may_swap: dict[torch._ops.OpOverload, bool] = {}
        self._aliasing: dict[torch._ops.OpOverload, bool] = {}

    def always_recompute(self, func: torch._ops.OpOverload) -> bool:
        """Whether ``func`` is a view or in-place op (cached per op)."""
        hit = self._aliasing.get(func)
        if hit is None:
            hit = self._aliasing[func] = aliasing(func)
        return hit

    def may_swap(self, func: torch._ops.OpOverload) -> bool:
        """Whether the policy's rules map ``func`` to "swap" and it neither aliases nor
        mutates (cached per op)."""
        hit = self._may_swap.get(func)
        if hit is None:
            assert isinstance(self.policy, ActivationPolicy)
            hit = self.policy.rule_action(func) == "swap" and not aliasing(func)
            self._may_swap[func] = hit
        return hit

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        group = None
        if self.swapper is not None:
            group = self.swapper.begin_group(self.module, (args, kwargs))
        region = _Region(self, group)
        key: tuple[object, ...] = ()
        if isinstance(self.policy, BudgetPolicy):
            key = signature(args) + signature(tuple(kwargs.values()))
            known = self.plans.get(key)
            if known is not None:
                region.plan, region.plan_ops = known
        out = checkpoint(
            self.original,
            *args,
            use_reentrant=False,
            context_fn=region.contexts,
            preserve_rng_state=self.preserve_rng_state,
            **kwargs,
        )
        if isinstance(self.policy, BudgetPolicy) and region.plan is None:
            self.plans[key] = (self.policy.plan(region.ops), tuple(f for f, _, _ in region.ops))
        if group is not None and self.swapper is not None:
            self.swapper.end_group(group, out)
        return out


def checkpoint_wrapper(
    module: nn.Module,
    policy: Policy = FULL_RECOMPUTE,
    *,
    swapper: Swapper | None = None,
    preserve_rng_state: bool = True,
) -> nn.Module:
    """Checkpoint ``module``'s forward (in place) under ``policy``.

    Args:
        module: the layer; its type, parameters and state dict are unchanged.
        policy: an :class:`~hp_offload.policy.ActivationPolicy` (save / swap / recompute by op
            kind or op; default: recompute everything) or a
            :class:`~hp_offload.policy.BudgetPolicy` (save the most valuable outputs up to a
            byte budget per call).
        swapper: where swapped outputs go; required iff the policy swaps. Share one among the
            layers of a model so prefetch runs one layer ahead.
        preserve_rng_state: restore the RNG state for recomputation (random ops recompute
            bit-equal).

    Postconditions: forward outputs and gradients are bit-equal to the unwrapped module's
    (given deterministic kernels); with no grad enabled the module runs unwrapped. Raises
    ValueError for a swapping policy without a swapper (or a swapper with a policy that never
    swaps), or if ``module`` is already wrapped.
    """
    if not isinstance(policy, (ActivationPolicy, BudgetPolicy)):
        raise TypeError(
            f"policy must be an ActivationPolicy or a BudgetPolicy, got {type(policy).__name__}"
        )
    swaps = isinstance(policy, ActivationPolicy) and policy.uses_swap
    if swaps and swapper is None:
        raise ValueError(
            "the policy swaps outputs to host memory: pass swapper=Swapper() "
            "(share it among layers)"
        )
    if swapper is not None and not swaps:
        raise ValueError(
            "a swapper was given but the policy swaps nothing: "
            "add a 'swap' rule or drop the swapper"
        )
    wrapper = _Wrapper(module, policy, swapper, preserve_rng_state)
    mark_wrapped(module, "checkpoint", wrapper.forward)
    return module
