"""The per-module state of fully_shard and the hooks that drive it.

Forward: the pre-hook of a module unshards its group (waiting for a prefetched all-gather if
one was issued) and prefetches the next group in forward order; the post-hook reshards (unless
the module is the root) and registers pre-backward hooks on the outputs. Backward: the first
gradient reaching a module's outputs unshards it again, gets its group ready to collect
gradients and prefetches the next group in backward order (the reverse of the order forwards
finished in); as each parameter's gradient is accumulated, the group takes it from the
parameter, and when every one is in, the group flattens them into its gradient buffer and its
reduce-scatter is issued into the root's gradient arena. A callback at the end of backward
finishes groups whose parameters got no gradient, waits for the arena's collectives once,
hands out the sharded gradients and reshards. A forward that activation checkpointing reruns
inside backward only unshards (and
casts): backward's order prefetches and reshards.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from hp_fsdp._arena import GradArena
from hp_fsdp._group import FSDPParamGroup
from hp_fsdp.policy import PrefetchPolicy, default_prefetch
from hp_fsdp.prefetch_plan import Direction, decide_prefetch
from hp_fsdp.reduce_overlap import decide_reduce_overlap
from hp_fsdp.replicate_buckets import ReplicateBuckets, bucket_cap_bytes, plan_replicate_buckets

__all__ = ["FSDPState", "TrainingState", "attach_fsdp_state", "fsdp_state"]


class TrainingState(enum.Enum):
    """What a fully_shard'ed module is doing."""

    IDLE = "idle"
    """Between passes."""
    FORWARD = "forward"
    """Its forward is running."""
    PRE_BACKWARD = "pre_backward"
    """Its outputs got gradients; its parameters' gradients are being computed."""
    POST_BACKWARD = "post_backward"
    """Its gradients were handed to the reduce-scatter."""


@dataclass
class _RootContext:
    """What the root shares with every state under it."""

    states: list[FSDPState]
    root_state: FSDPState
    forward_order: list[FSDPState] = field(default_factory=list)
    # The order forwards finish in: backward runs in its reverse, nested states included
    # (an inner state finishes before the one around it, and its backward comes first).
    post_forward_order: list[FSDPState] = field(default_factory=list)
    recording: bool = True
    callback_queued: bool = False
    arena: GradArena | None = None
    arena_index: dict[int, int] = field(default_factory=dict)
    arena_groups: list[FSDPParamGroup] = field(default_factory=list)


class FSDPState:
    """fully_shard's bookkeeping for one module."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        groups: Sequence[FSDPParamGroup],
        reshard_after_forward: bool,
        output_dtype: torch.dtype | None,
        input_dtype: torch.dtype | None,
        auto_reshard_after_forward: bool = False,
    ) -> None:
        self.modules = list(modules)
        self.groups = list(groups)
        self.reshard_after_forward = reshard_after_forward
        # fully_shard got reshard_after_forward=None: True, but False if this turns out to be
        # the root (FSDP2's rule); an explicit value, or set_reshard_after_forward, is kept.
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        # FSDP2's set_is_last_backward: recorded; every backward finishes its reductions.
        self.is_last_backward = True
        self.output_dtype = output_dtype
        self.input_dtype = input_dtype
        self.training = TrainingState.IDLE
        self.root: _RootContext | None = None
        self.is_root: bool | None = None
        self.gradient_divide_factor: float | None = None
        self.implicit_prefetch = (
            default_prefetch(groups[0].device) if groups else PrefetchPolicy(False, False)
        )
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._backward_started = False
        self._post_backward_done = False
        self._accumulated = 0
        self._needed = 0
        self._hooked: set[int] = set()
        # Members (indices into ``modules``) whose forward finished in this pass; None
        # between passes. The group reshards once every member has run.
        self._forward_done: set[int] | None = None

    @property
    def module(self) -> nn.Module:
        """The (first) module this state was created for."""
        return self.modules[0]

    @property
    def group(self) -> FSDPParamGroup | None:
        """The one flat buffer group of this state (None without parameters).

        Raises:
            ValueError: the state has one group per storage dtype; use ``groups``.
        """
        if len(self.groups) > 1:
            raise ValueError(
                f"the fully_shard state of {self.groups[0].owner!r} has "
                f"{len(self.groups)} flat buffers (one per storage dtype); use .groups"
            )
        return self.groups[0] if self.groups else None

    def member_index(self, module: nn.Module) -> int:
        """The position of ``module`` among the modules this state shards."""
        for index, member in enumerate(self.modules):
            if member is module:
                return index
        raise ValueError(f"{type(module).__name__} is not sharded by this fully_shard state")

    # Root ------------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        states: list[FSDPState] = []
        for member in self.modules:
            for m in member.modules():
                found = fsdp_state(m)
                if found is not None and all(found is not s for s in states):
                    states.append(found)
        seen: dict[int, str] = {}
        for state in states:
            if state is not self and state.is_root is None:
                state.is_root = False
            for group in state.groups:
                for p in group.params:
                    key = id(p.sharded)
                    if key in seen:
                        raise ValueError(
                            f"parameter {p.fqn!r} belongs to two fully_shard groups "
                            f"({seen[key]!r} and {group.owner!r}); shard the modules sharing "
                            "it together"
                        )
                    seen[key] = group.owner
        self.is_root = True
        if self.auto_reshard_after_forward:
            # The root's parameters are needed right at the start of backward: keep them,
            # unless the user asked otherwise (as FSDP2).
            self.reshard_after_forward = False
        context = _RootContext(states, self)
        for state in states:
            state.root = context
        # Gradient arena entries: every group, in backward order.
        backward = [g for s in reversed(states) for g in s.groups]
        if backward:
            first = backward[-1]
            # The arena holds reduced gradients: their dtype is a trainable group's (a group
            # of frozen parameters in another dtype, FP8 weights say, reduces nothing).
            trainable = [g for g in backward if g.trainable] or backward
            fsdp = first.fsdp
            wire = _replicate_wire(backward)
            replicate = (
                fsdp.mesh.get_group(fsdp.replicate_axis)
                if fsdp.replicate_axis is not None
                else None
            )
            context.arena = GradArena(
                [g.plan.chunk_numel for g in backward],
                trainable[-1].reduce_dtype,
                first.device,
                fsdp.shard_size,
                replicate,
                fsdp.replicate_size,
                _replicate_buckets(backward, wire).buckets,
                wire,
            )
            context.arena_index = {id(g): i for i, g in enumerate(backward)}
            context.arena_groups = backward

    # Forward ---------------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self.is_root is None:
            self._lazy_init()
        root = self.root
        assert root is not None
        if _recomputing():
            # Activation checkpointing reruns this forward inside backward: the parameters
            # are needed, but backward's own order drives prefetching and resharding, so a
            # prefetch of the next group in forward order would all-gather a block whose
            # backward already ran (or is far away), and no state may change.
            for group in self.groups:
                group.unshard(async_op=True)
            for group in self.groups:
                group.wait()
            if self.input_dtype is not None:
                args, kwargs = _cast((args, kwargs), self.input_dtype)
            return args, kwargs
        if self.is_root:
            for state in root.states:
                state._backward_started = False
                state._post_backward_done = False
        if root.recording and self.groups and self not in root.forward_order:
            root.forward_order.append(self)
        self.training = TrainingState.FORWARD
        if self._forward_done is None:
            self._forward_done = set()
            for group in self.groups:
                group.unshard(async_op=True)
            for group in self.groups:
                group.wait()
            for nxt in self._next(self.forward_prefetch, root.forward_order, +1):
                for group in nxt.groups:
                    group.unshard(async_op=True)
        if self.input_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.input_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if _recomputing():
            # The recomputed outputs are not in the graph backward walks (its hooks sit on the
            # first forward's outputs), and the group stays unsharded for the backward about
            # to use it; its post-backward reshards it.
            return output if self.output_dtype is None else _cast(output, self.output_dtype)
        done = self._forward_done if self._forward_done is not None else set()
        done.add(self.member_index(module))
        last = len(done) == len(self.modules)
        self._forward_done = None if last else done
        if last and self.reshard_after_forward:
            for group in self.groups:
                group.reshard()
        root = self.root
        assert root is not None
        if last and root.recording and self.groups and self not in root.post_forward_order:
            root.post_forward_order.append(self)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        if self.is_root:
            root.recording = False
        self.training = TrainingState.IDLE
        if self.output_dtype is not None:
            output = _cast(output, self.output_dtype)
        return output

    def _next(
        self, explicit: list[FSDPState] | None, order: list[FSDPState], step: int
    ) -> list[FSDPState]:
        if explicit is not None:
            return explicit
        if self not in order:
            return []
        index = order.index(self) + step
        if not 0 <= index < len(order):
            return []
        candidate = order[index]
        policy = self.implicit_prefetch
        implicit = policy.forward if step > 0 else policy.backward
        direction = Direction.FORWARD if step > 0 else Direction.BACKWARD
        decisions = [
            decide_prefetch(
                direction, implicit, g.fsdp.shard_size, g.unsharded_bytes, policy.max_bytes
            )
            for g in candidate.groups
        ]
        return [candidate] if decisions and all(d.prefetch for d in decisions) else []

    # Backward --------------------------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        if self._backward_started:
            return
        self._backward_started = True
        root = self.root
        assert root is not None
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                root.root_state._final_callback_root
            )
        self.training = TrainingState.PRE_BACKWARD
        self._forward_done = None
        if self.groups:
            for group in self.groups:
                group.unshard(async_op=True)
            for group in self.groups:
                group.wait()
                group.prepare_gradients()
            self._hook_accumulation()
            self._accumulated = 0
        for prev in self._next(self.backward_prefetch, root.post_forward_order, -1):
            for group in prev.groups:
                group.unshard(async_op=True)

    def _hook_accumulation(self) -> None:
        needed = 0
        for group in self.groups:
            for index, p in enumerate(group.params):
                leaf = p.leaf
                if leaf is None or not leaf.requires_grad:
                    continue
                needed += 1
                if id(leaf) in self._hooked:
                    continue
                # A weak reference: autograd keeps hooks in C++, where a cycle back to this
                # state would never be collected.
                hook = _weak_accumulated_hook(weakref.ref(self), weakref.ref(group), index)
                leaf.register_post_accumulate_grad_hook(hook)
                self._hooked.add(id(leaf))
        self._needed = needed

    def accumulated(self, group: FSDPParamGroup, index: int) -> None:
        """Parameter ``index`` of ``group`` has its gradient: move it into the flat gradient
        buffer; reduce when every parameter's is in."""
        group.take_gradient(index)
        self._accumulated += 1
        if self._accumulated >= self._needed:
            self.post_backward()

    def post_backward(self) -> None:
        """Hand this group's gradients to the reduce-scatter (or keep accumulating)."""
        if self._post_backward_done or not self.groups:
            return
        self._post_backward_done = True
        self.training = TrainingState.POST_BACKWARD
        root = self.root
        assert root is not None
        if root.arena is not None:
            # The previous group's reduce-scatter, if held, before this one allocates anything.
            root.arena.drain()
        for group in self.groups:
            # Free the unsharded parameters before the reduce-scatter allocates anything (as
            # FSDP2 does): the gradient no longer needs them.
            if self.reshard_after_backward and not self.is_root:
                group.reshard()
            if self.requires_gradient_sync and group.has_gradients:
                assert root.arena is not None
                index = root.arena_index[id(group)]
                target = root.arena.chunk(index)
                accumulate = None
                if any(p.sharded.grad is not None for p in group.params if p.sharded.requires_grad):
                    accumulate = torch.empty_like(target)
                    target_for_rs = accumulate
                else:
                    target_for_rs = target
                overlap = decide_reduce_overlap(root.arena.reduced, group.fsdp.shard_size > 1)
                work = group.reduce_scatter(target_for_rs)
                root.arena.submit(
                    index,
                    work,
                    group.release_gradients,
                    accumulate,
                    self.requires_all_reduce,
                    hold=overlap.hold,
                )

    def _final_callback_root(self) -> None:
        root = self.root
        assert root is not None
        assert self.is_root
        for state in reversed(root.states):
            if state._backward_started and not state._post_backward_done:
                state.post_backward()
        if root.arena is not None:
            for reduced in root.arena.finish(self.gradient_divide_factor):
                group = root.arena_groups[reduced.index]
                group.assign_sharded_gradients(reduced.chunk, reduced.accumulate)
        for state in root.states:
            if state.reshard_after_backward:
                for group in state.groups:
                    group.reshard()
            state._forward_done = None
            state.training = TrainingState.IDLE
            state._backward_started = False
            state._post_backward_done = False
        root.callback_queued = False


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's recompute):
    autograd's engine has a current graph task only while it executes one."""
    return torch._C._current_graph_task_id() != -1


def _replicate_buckets(
    backward: list[FSDPParamGroup], wire: tuple[torch.dtype, int] | None
) -> ReplicateBuckets:
    """The replicate-axis buckets of a root's groups (backward order) whose chunks go on the
    slow tier as ``wire`` (None: their reduce dtype): cut at the cost model's cap for those
    bytes (every group alone without HSDP, where nothing is all-reduced)."""
    fsdp = backward[-1].fsdp
    tier = fsdp.replicate_tier
    trainable = [g for g in backward if g.trainable] or backward
    itemsize = (wire[0] if wire is not None else trainable[-1].reduce_dtype).itemsize
    sizes = [g.plan.chunk_numel * itemsize for g in backward]
    if tier is None or fsdp.replicate_size == 1:
        return plan_replicate_buckets(sizes, 1)
    cap = bucket_cap_bytes(sum(sizes), fsdp.replicate_size, tier.latency, tier.bandwidth)
    return plan_replicate_buckets(sizes, cap)


def _replicate_wire(groups: list[FSDPParamGroup]) -> tuple[torch.dtype, int] | None:
    """The replicate-axis wire of the root's gradient arena, which fuses the all-reduces of
    all groups: every group must ask for the same one."""
    wires = {
        (g.comm_policy.replicate_reduce_dtype, g.comm_policy.block_size)
        if g.comm_policy.replicate_reduce_dtype not in (None, torch.float32)
        else None
        for g in groups
    }
    if len(wires) > 1:
        owners = {g.owner: g.comm_policy.replicate_reduce_dtype for g in groups}
        raise NotImplementedError(
            f"fully_shard groups under one root ask for different replicate_reduce_dtype (or "
            f"block_size): {owners}; the slow-tier all-reduce is fused across groups, so give "
            "every fully_shard call the same LowPrecisionCommPolicy replicate settings"
        )
    return next(iter(wires))


def _weak_accumulated_hook(
    ref: weakref.ReferenceType[FSDPState], group: weakref.ReferenceType[FSDPParamGroup], index: int
) -> Any:
    def hook(leaf: torch.Tensor) -> None:
        state, owner = ref(), group()
        if state is not None and owner is not None:
            state.accumulated(owner, index)

    return hook


def _cast(value: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, value)


# The one place the attribute is named: a module's fully_shard state is read and written through
# these two functions only.
_STATE_ATTR = "_hp_fsdp_state"


def fsdp_state(module: nn.Module) -> FSDPState | None:
    """The fully_shard state of ``module`` (shared by the modules of one list call), or None
    for a module fully_shard has not sharded itself (a submodule of one included)."""
    state: FSDPState | None = module.__dict__.get(_STATE_ATTR)
    return state


def attach_fsdp_state(module: nn.Module, state: FSDPState) -> None:
    """Make ``state`` the fully_shard state of ``module``."""
    module.__dict__[_STATE_ATTR] = state
