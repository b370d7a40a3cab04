"""The order one microbatch's FSDP collectives are issued and waited in, as the runtime does.

:func:`microbatch_program` writes a :mod:`~hp_planner.price.timeline` program for one
microbatch's forward and backward over a tree of :class:`Unit` (one per ``fully_shard`` state:
the root, its blocks, an MoE layer's expert group inside its block), following what the
runtimes do:

* **hp-fsdp** (``hp_fsdp._state``, ``hp_fsdp._arena``). A unit's forward start issues its
  all-gather unless it was prefetched, waits for it, then prefetches the next unit in the order
  forwards start (forward prefetch). Its forward end reshards it (not the root). A unit's
  backward starts when its outputs get their gradient: it re-gathers (unless prefetched),
  waits, prefetches the next unit in the reverse of the order forwards finish in (backward
  prefetch), then reruns its checkpointed forward (the recompute gathers nested units as it
  reaches them and prefetches nothing). Its backward ends when its parameters' gradients are
  in: its reduce-scatter is issued. Reduce-scatters go into buckets of reduced chunks in
  backward order under HSDP, each closed once it holds ``hsdp_bucket_bytes`` (the runtime's
  cap, :func:`hp_fsdp.replicate_buckets.bucket_cap_bytes`; one unit per bucket without HSDP);
  the first reduce-scatter of the backward is waited for at once, every later one is held
  until the next unit's reduction starts (:func:`hp_fsdp.reduce_overlap.decide_reduce_overlap`),
  and when a bucket's last one is complete, on the microbatch that all-reduces, one all-reduce
  of the bucket goes to the replicate tier. The end of backward waits for every bucket's
  all-reduce.
* **torch FSDP2** (modeled baseline). The same prefetching; its copy-in before each
  all-gather and reduce-scatter and copy-out after each are compute-stream time charged to that
  collective's kind; a reduce-scatter stays in flight until the next one is issued; its
  replicate all-reduce follows each reduce-scatter, on every microbatch.
* **Megatron DDP** (modeled baseline). No gathers; each unit's gradient all-reduce is issued
  when its backward ends (buckets of :data:`DDP_BUCKET_BYTES`), on the microbatch that
  all-reduces (the last of a step), and waited for at the end of backward.

* **Activation swap** (``hp_offload.Swapper``, every runtime alike). A block's kept
  activations are copied to host memory on the :data:`SWAP_TIER` stream, taken as issued when its
  forward ends (the real copies start as each tensor is saved: this is the late bound); the
  next block's forward end waits for that copy (the swapper retires older offloads there). A
  block's backward start fetches its own (waiting first for its offload if still in flight)
  and the previous block's activations, and waits for its own before recomputing or computing
  on them.

Compute between unit boundaries is each unit's ``forward`` segments, backward twice that.
Collectives of tensor, expert and context parallelism are not part of the program (the
planner adds them as exposed: the runtime waits on each at once).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from hp_fsdp.reduce_overlap import decide_reduce_overlap
from hp_planner.price.timeline import Compute, Issue, Mark, Op, Wait

__all__ = ["DDP_BUCKET_BYTES", "SWAP_KIND", "SWAP_TIER", "Runtime", "Unit", "microbatch_program"]

DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""Megatron DDP's gradient bucket (torch DDP's default ``bucket_cap_mb``)."""

FORWARD_END = "forward end"
"""The :class:`~hp_planner.price.timeline.Mark` between forward and backward."""

SWAP_KIND = "activation_swap"
"""The kind activation swap copies are charged to."""

SWAP_TIER = "device-host copies"
"""The stream activation swap copies run on (the swapper's one side stream), named apart from
every topology tier (``host`` is one)."""


class Runtime(Enum):
    """Whose order the program follows."""

    HP = "hp"
    """hp-fsdp."""
    TORCH_FSDP2 = "torch_fsdp2"
    """torch FSDP2, as modeled (module doc)."""
    MEGATRON_DDP = "megatron_ddp"
    """Megatron's DDP, as modeled."""


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` state (a module and what it holds), seconds per microbatch.

    Attributes:
        name: its module's name (``"root"``, ``"layers.3"``, ``"layers.3.ffn"``).
        forward: its own forward compute before, between and after its children (one more
            than ``children``).
        children: the units nested in it, in forward order.
        gather: its forward all-gather (0: nothing to gather).
        regather: its backward re-gather (0: kept unsharded from forward, the root).
        scatter: its gradients' reduce-scatter.
        replicate: its reduced chunk's all-reduce over the replicate axis (HSDP; DDP's
            gradient all-reduce), 0 without one.
        chunk_bytes: the bytes of its reduced gradient chunk (what fills a bucket).
        tier: the tier its gathers and reduce-scatters run on.
        replicate_tier: the tier of its all-reduce.
        recompute: the share of its forward its activation checkpointing reruns at its
            backward start (0 to 1; the nested units' included).
        gather_copy: torch FSDP2's copy-in plus copy-out seconds around each of its gathers.
        scatter_copy: the same around its reduce-scatter.
        swap: seconds to copy its swapped activations one way (0: nothing swapped).
    """

    name: str
    forward: tuple[float, ...]
    children: tuple[Unit, ...] = ()
    gather: float = 0.0
    regather: float = 0.0
    scatter: float = 0.0
    replicate: float = 0.0
    chunk_bytes: int = 0
    tier: str = ""
    replicate_tier: str = ""
    recompute: float = 0.0
    gather_copy: float = 0.0
    scatter_copy: float = 0.0
    swap: float = 0.0

    def __post_init__(self) -> None:
        if len(self.forward) != len(self.children) + 1:
            raise ValueError(
                f"unit {self.name!r}: {len(self.forward)} forward segments for "
                f"{len(self.children)} children; give one more segment than children"
            )

    def preorder(self) -> Iterator[Unit]:
        """This unit, then its children's subtrees: the order forwards start in."""
        yield self
        for child in self.children:
            yield from child.preorder()

    def postorder(self) -> Iterator[Unit]:
        """The children's subtrees, then this unit: the order forwards finish in."""
        for child in self.children:
            yield from child.postorder()
        yield self


@dataclass
class _Writer:
    """The program being written and what the runtime knows while writing it."""

    runtime: Runtime
    prefetch_forward: bool
    prefetch_backward: bool
    all_reduce: bool
    hsdp_bucket_bytes: int
    forward_next: dict[str, Unit]
    backward_next: dict[str, Unit]
    swap_previous: dict[str, Unit]
    ops: list[Op] = field(default_factory=list)
    unsharded: set[str] = field(default_factory=set)
    issued: set[str] = field(default_factory=set)
    in_flight: list[str] = field(default_factory=list)
    bucket: list[Unit] = field(default_factory=list)
    bucket_bytes: int = 0
    closed: bool = False  # the bucket is full, its last reduce-scatter still held
    reduced: int = 0  # reduce-scatters issued in this backward
    replicated: list[str] = field(default_factory=list)
    offloading: list[str] = field(default_factory=list)

    # Gathers -----------------------------------------------------------------------------

    def _copy(self, unit: Unit, kind: str, name: str) -> None:
        seconds = unit.gather_copy if kind == "fsdp_all_gather" else unit.scatter_copy
        if self.runtime is Runtime.TORCH_FSDP2 and seconds:
            # On the compute stream: an immediately waited "collective" of the copy's seconds,
            # charged to the kind it serves (half before the collective, half after).
            self.ops += [Issue(name, kind, "compute", seconds / 2), Wait(name)]

    def prefetch(self, unit: Unit, phase: str) -> None:
        seconds = unit.gather if phase == "forward" else unit.regather
        name = f"{phase} gather {unit.name}"
        if not seconds or unit.name in self.unsharded or name in self.issued:
            return
        self._copy(unit, "fsdp_all_gather", f"copy-in {name}")
        self.ops.append(Issue(name, "fsdp_all_gather", unit.tier, seconds))
        self.issued.add(name)

    def unshard(self, unit: Unit, phase: str) -> None:
        seconds = unit.gather if phase == "forward" else unit.regather
        if not seconds or unit.name in self.unsharded:
            return
        name = f"{phase} gather {unit.name}"
        self.prefetch(unit, phase)
        self.ops.append(Wait(name))
        self._copy(unit, "fsdp_all_gather", f"copy-out {name}")
        self.unsharded.add(unit.name)

    # Forward -----------------------------------------------------------------------------

    def forward(self, unit: Unit, recomputing: float = 0.0) -> None:
        """``unit``'s forward; with ``recomputing``, the share a checkpoint reruns."""
        self.unshard(unit, "backward" if recomputing else "forward")
        if self.prefetch_forward and not recomputing:
            nxt = self.forward_next.get(unit.name)
            if nxt is not None:
                self.prefetch(nxt, "forward")
        scale = recomputing or 1.0
        label = ("recompute " if recomputing else "forward ") + unit.name
        for index, seconds in enumerate(unit.forward):
            if seconds:
                self.ops.append(Compute(seconds * scale, label))
            if index < len(unit.children):
                self.forward(unit.children[index], recomputing)
        if not recomputing and unit.regather:
            self.unsharded.discard(unit.name)  # resharded after forward
        if not recomputing and unit.swap:
            name = f"offload {unit.name}"
            self.ops.append(Issue(name, SWAP_KIND, SWAP_TIER, unit.swap))
            for earlier in self.offloading:
                self.ops.append(Wait(earlier))
            self.offloading = [name]

    # Activation swap ---------------------------------------------------------------------

    def fetch(self, unit: Unit) -> None:
        """Start copying ``unit``'s swapped activations back (once)."""
        name = f"fetch {unit.name}"
        if name in self.issued:
            return
        offload = f"offload {unit.name}"
        if offload in self.offloading:
            self.ops.append(Wait(offload))
            self.offloading.remove(offload)
        self.ops.append(Issue(name, SWAP_KIND, SWAP_TIER, unit.swap))
        self.issued.add(name)

    # Backward ----------------------------------------------------------------------------

    def backward(self, unit: Unit) -> None:
        self.unshard(unit, "backward")
        if self.prefetch_backward:
            nxt = self.backward_next.get(unit.name)
            if nxt is not None:
                self.prefetch(nxt, "backward")
        if unit.swap:
            self.fetch(unit)
            previous = self.swap_previous.get(unit.name)
            if previous is not None:
                self.fetch(previous)
            self.ops.append(Wait(f"fetch {unit.name}"))
        if unit.recompute:
            # After the pre-backward hook: the first saved tensor backward unpacks reruns it.
            self.forward(unit, recomputing=unit.recompute)
        for index in reversed(range(len(unit.forward))):
            if index < len(unit.children):
                self.backward(unit.children[index])
            if unit.forward[index]:
                self.ops.append(Compute(2 * unit.forward[index], f"backward {unit.name}"))
        self.reduce(unit)
        if unit.regather:
            self.unsharded.discard(unit.name)  # resharded after backward

    def reduce(self, unit: Unit) -> None:
        """``unit``'s gradients are in: its reduce-scatter (or DDP's all-reduce)."""
        if self.runtime is Runtime.MEGATRON_DDP:
            self._bucket(unit)
            return
        if not unit.scatter:
            return
        name = f"reduce-scatter {unit.name}"
        if self.runtime is Runtime.TORCH_FSDP2:
            for earlier in self.in_flight:
                self.ops.append(Wait(earlier))
                self._copy(unit, "fsdp_reduce_scatter", f"copy-out {earlier}")
            self._copy(unit, "fsdp_reduce_scatter", f"copy-in {name}")
            self.ops.append(Issue(name, "fsdp_reduce_scatter", unit.tier, unit.scatter))
            self.in_flight = [name]
            if unit.replicate and self.all_reduce:
                reduce = f"all-reduce {unit.name}"
                self.ops.append(
                    Issue(reduce, "hsdp_all_reduce", unit.replicate_tier, unit.replicate, name)
                )
                self.replicated.append(reduce)
            return
        # The arena: the reduce-scatter held from the unit before completes first, and its
        # bucket's all-reduce starts if that closed the bucket.
        for earlier in self.in_flight:
            self.ops.append(Wait(earlier))
        self.in_flight = []
        if self.closed:
            self._fire()
        self.ops.append(Issue(name, "fsdp_reduce_scatter", unit.tier, unit.scatter))
        hold = decide_reduce_overlap(self.reduced, communicates=True).hold
        self.reduced += 1
        if hold:
            self.in_flight = [name]
        else:
            self.ops.append(Wait(name))
        self._bucket(unit)

    def _bucket(self, unit: Unit) -> None:
        """hp-fsdp's arena (and DDP's buckets): a bucket fires when its last unit is in (hp-fsdp:
        when that unit's reduce-scatter is complete)."""
        self.bucket.append(unit)
        self.bucket_bytes += unit.chunk_bytes
        # Without a replicate all-reduce every unit is a bucket of its own (the arena's limit
        # is then one byte) and firing it issues nothing.
        if self.runtime is Runtime.MEGATRON_DDP:
            cap = DDP_BUCKET_BYTES
        else:
            cap = self.hsdp_bucket_bytes if unit.replicate else 1
        if self.bucket_bytes >= cap:
            # hp-fsdp's bucket fires once its last reduce-scatter is complete: now, or when the
            # next unit's reduction completes a held one (or at the end of backward).
            if self.in_flight and self.runtime is not Runtime.MEGATRON_DDP:
                self.closed = True
            else:
                self._fire()

    def _fire(self) -> None:
        if not self.bucket:
            return
        ddp = self.runtime is Runtime.MEGATRON_DDP
        for name in self.in_flight:
            self.ops.append(Wait(name))  # the bucket's last reduce-scatter, if still held
        self.in_flight = []
        self.closed = False
        seconds = sum(u.replicate for u in self.bucket)
        if seconds and self.all_reduce:
            name = f"all-reduce {self.bucket[0].name}"
            kind = "ddp_all_reduce" if ddp else "hsdp_all_reduce"
            self.ops.append(Issue(name, kind, self.bucket[0].replicate_tier, seconds))
            self.replicated.append(name)
        self.bucket, self.bucket_bytes = [], 0

    def finish(self) -> None:
        """The end of backward: what is left fired, everything waited for."""
        self._fire()
        for name in self.in_flight:
            self.ops.append(Wait(name))
        self.in_flight = []
        for name in self.replicated:
            self.ops.append(Wait(name))
        self.replicated = []


def microbatch_program(
    root: Unit,
    runtime: Runtime = Runtime.HP,
    *,
    prefetch_forward: bool = True,
    prefetch_backward: bool = True,
    all_reduce: bool = True,
    hsdp_bucket_bytes: int = DDP_BUCKET_BYTES,
) -> list[Op]:
    """One microbatch's forward and backward over ``root`` (module doc), a
    :data:`FORWARD_END` mark between them; ``all_reduce``: the replicate all-reduce runs on this
    microbatch (hp-fsdp: the last of a step; torch FSDP2: every one); ``hsdp_bucket_bytes``:
    where hp-fsdp closes a replicate-axis bucket."""
    forward_order = list(root.preorder())
    backward_order = list(reversed(list(root.postorder())))
    names = [u.name for u in forward_order]
    if len(set(names)) != len(names):
        raise ValueError(f"unit names repeat in {names}; each unit needs its own")
    swapping = [u for u in forward_order if u.swap]
    writer = _Writer(
        runtime,
        prefetch_forward,
        prefetch_backward,
        all_reduce,
        hsdp_bucket_bytes,
        forward_next={a.name: b for a, b in itertools.pairwise(forward_order)},
        backward_next={a.name: b for a, b in itertools.pairwise(backward_order)},
        swap_previous={b.name: a for a, b in itertools.pairwise(swapping)},
    )
    writer.forward(root)
    writer.ops.append(Mark(FORWARD_END))
    writer.backward(root)
    writer.finish()
    return writer.ops
