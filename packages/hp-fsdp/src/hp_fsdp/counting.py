"""Counted, not guessed: which kernels and collectives a training step runs.

:class:`CountingMode` is a ``TorchDispatchMode`` used as a context manager around a step. It
counts every operator that reaches the dispatcher by name (``"aten.copy_"``,
``"c10d._allgather_base_"``, ``"fsdp.all_gather_copy_in"``), and records every collective
issued (its kind, the global ranks of its process group, the bytes of its largest tensor)::

    with CountingMode() as counts:
        loss = model(batch).sum()
        loss.backward()
    counts.copy_count            # copy kernels the step ran
    counts.collective_counts()   # {("all_gather", 2): 5, ("reduce_scatter", 2): 3}

Copy kernels (:func:`is_copy_kernel`) are the operators that move elements from one tensor into
another without arithmetic: ``copy_``, ``_to_copy`` (``.to``/casts), ``clone`` (also what
``.contiguous()`` runs), ``cat``/``stack``/``repeat``, flips, rolls and padding, gathers by index
(``index``, ``index_select``, ``gather``, ``embedding``, ...), the ``*_scatter`` and
``index_put_``/``index_copy`` families, every ``*_copy`` aten operator (the materialized views
such as ``split_with_sizes_copy``, ``_foreach_copy_``), and the custom copy operators of torch
FSDP2 (``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``,
``fsdp.copy_``) and of this project (``hp_kernels.pack``/``unpack`` and the CPU extension's
``hp_kernels_cpu.pack``/``unpack`` they call). A mode sees a custom operator as one call, not the
kernels inside it, so a custom operator that copies is only counted if it is named here: an
operator outside the namespaces classified by rule (``aten``, the collectives and the
profiler's markers) and not named in :data:`COPY_KERNELS` or :data:`NON_COPY_CUSTOM_OPS` is
*unclassified* (:meth:`CountingMode.unclassified`), and a claim "adds no copy" must also check
that the step ran none. Fills (``zeros``, ``zero_``, ``fill_``, ...) and in-place additions
(``add_``, ...) are counted by their own helpers: an accumulating gradient buffer costs a fill
and one in-place addition per parameter, not a copy.

Memory. :class:`PeakMemoryMode` measures the peak bytes of live tensor storage over the operators
run under it (every tensor reachable from Python when it starts, and every tensor an operator
reads or writes after that), on any device, CPU included; see its docstring for the method.

Purposes and bytes. hp-fsdp tags each collective it issues with what it is for
(:func:`collective_purpose`: ``"param_all_gather"``, ``"grad_reduce_scatter"``,
``"grad_all_reduce"``), whatever primitive carries it (a low-precision reduce-scatter is an
all-to-all); :meth:`CountingMode.bytes_by` sums bytes by purpose or kind, optionally over one
process group (one mesh axis)::

    counts.bytes_by("purpose", ranks=shard_group_ranks)  # {"param_all_gather": 81920, ...}

By default these are *wire bytes* (:attr:`CollectiveCall.wire_bytes`): what each rank sends
under a bandwidth-optimal algorithm, ``(n - 1) / n`` of the unsharded side for an all-gather,
reduce-scatter or all-to-all and twice that for an all-reduce (a reduce-scatter plus an
all-gather), so an all-reduce and its low-precision reduce-scatter + all-gather replacement
compare fairly; ``wire=False`` sums :attr:`CollectiveCall.nbytes` instead.

Backend internals. A collective's work handle may run kernels when it is waited for (gloo's
``reduce_scatter_single`` reduces into a scratch buffer, then splits it and copies this rank's
chunk into the output inside ``Work.wait``; NCCL writes the output directly). While the mode
is active, ``torch.distributed.Work.wait`` is wrapped so that operators run inside a wait are
counted in :attr:`CountingMode.backend_ops` instead of :attr:`CountingMode.ops`: they belong to
the communication library, not to the code under test.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hp_fsdp._purpose import collective_purpose, current_purpose

__all__ = [
    "COPY_KERNELS",
    "FILL_KERNELS",
    "INPLACE_ADD_KERNELS",
    "NON_COPY_CUSTOM_OPS",
    "CollectiveCall",
    "CountingMode",
    "PeakMemoryMode",
    "collective_kind",
    "collective_purpose",
    "current_purpose",
    "extra_counts",
    "is_classified",
    "is_copy_kernel",
    "op_name",
]

COPY_KERNELS: Final[frozenset[str]] = frozenset(
    {
        # Plain copies and casts.
        "aten.copy_",
        "aten.copy",
        "aten._to_copy",
        "aten.clone",
        "aten.lift_fresh_copy",
        "aten._foreach_copy_",
        "aten._foreach_copy",
        # Concatenation.
        "aten.cat",
        "aten.stack",
        "aten._chunk_cat",
        "aten.repeat",
        # Writing one tensor into a region of another.
        "aten.index_put_",
        "aten.index_put",
        "aten._index_put_impl_",
        "aten.index_copy_",
        "aten.index_copy",
        "aten.masked_scatter_",
        "aten.masked_scatter",
        "aten.slice_scatter",
        "aten.select_scatter",
        "aten.diagonal_scatter",
        "aten.as_strided_scatter",
        # Materialized views (functionalized variants).
        "aten.split_with_sizes_copy",
        "aten.split_copy",
        "aten.narrow_copy",
        "aten.slice_copy",
        "aten.view_copy",
        "aten.as_strided_copy",
        "aten.permute_copy",
        "aten.transpose_copy",
        "aten.t_copy",
        "aten.expand_copy",
        "aten.unsqueeze_copy",
        "aten.squeeze_copy",
        "aten.unbind_copy",
        "aten.alias_copy",
        "aten._reshape_copy",
        # Rearranging or padding one tensor into a new one.
        "aten.flip",
        "aten.roll",
        "aten.constant_pad_nd",
        "aten.unfold_copy",
        # Gathers by index (elements moved, positions read from an index tensor).
        "aten.index",
        "aten.index_select",
        "aten.gather",
        "aten.take",
        "aten.take_along_dim",
        "aten.masked_select",
        "aten.embedding",
        # Scatters of a source tensor (not scatter_add / scatter_reduce: those add).
        "aten.scatter",
        "aten.scatter_",
        "aten.put",
        "aten.put_",
        # torch FSDP2's custom copy-in / copy-out operators.
        "fsdp.all_gather_copy_in",
        "fsdp.split_with_sizes_copy",
        "fsdp.chunk_cat",
        "fsdp.copy_",
        # This project's own: many tensors into one flat buffer and back (with casts), and the
        # CPU extension's kernels behind them (seen when called directly).
        "hp_kernels.pack",
        "hp_kernels.unpack",
        "hp_kernels_cpu.pack",
        "hp_kernels_cpu.unpack",
    }
)
"""Operators (``namespace.name`` of the overload packet) that are copy kernels, besides the
aten ones :func:`is_copy_kernel` recognizes by name (``*_copy``, ``*_scatter``)."""

NON_COPY_CUSTOM_OPS: Final[frozenset[str]] = frozenset(
    {
        # Arithmetic (bf16 matmuls) into a fresh result.
        "hp_kernels.newton_schulz",
        "hp_kernels_cpu.newton_schulz",
        # Communication fused with a matmul (what they move is a collective, not a copy
        # kernel; CountingMode does not record them as collectives).
        "hp_kernels.all_gather_matmul",
        "hp_kernels.matmul_reduce_scatter",
    }
)
"""Custom operators (outside the rule-classified namespaces) known not to be copy kernels."""

# Namespaces whose operators are classified by rule: a name in COPY_KERNELS or with a copy
# suffix is a copy, anything else is not. Every other namespace's operators must be named.
_RULE_NAMESPACES: Final[frozenset[str]] = frozenset(
    # profiler: record_function markers (torch FSDP2 runs them), no tensor data.
    {"aten", "c10d", "_c10d_functional", "c10d_functional", "profiler"}
)
_COPY_SUFFIXES: Final[tuple[str, ...]] = ("_copy", "_copy_", "_scatter", "_scatter_")

FILL_KERNELS: Final[frozenset[str]] = frozenset(
    {
        "aten.zeros",
        "aten.zeros_like",
        "aten.new_zeros",
        "aten.zero_",
        "aten.fill_",
        "aten.full",
        "aten.full_like",
        "aten.new_full",
    }
)
"""Operators that write a constant (zero) into a tensor."""

INPLACE_ADD_KERNELS: Final[frozenset[str]] = frozenset({"aten.add_", "aten._foreach_add_"})
"""In-place additions (how a gradient accumulates into an existing ``.grad``)."""

_COLLECTIVE_KINDS: Final[Mapping[str, str]] = {
    "c10d._allgather_base_": "all_gather",
    "c10d.allgather_": "all_gather",
    "c10d.allgather_coalesced_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
    "c10d.allreduce_": "all_reduce",
    "c10d.allreduce_coalesced_": "all_reduce",
    "_c10d_functional.all_reduce": "all_reduce",
    "_c10d_functional.all_reduce_": "all_reduce",
    "_c10d_functional.all_reduce_coalesced": "all_reduce",
    "c10d.alltoall_base_": "all_to_all",
    "c10d.alltoall_": "all_to_all",
    "_c10d_functional.all_to_all_single": "all_to_all",
    "c10d.broadcast_": "broadcast",
    "_c10d_functional.broadcast": "broadcast",
    "c10d.reduce_": "reduce",
    "c10d.gather_": "gather",
    "c10d.scatter_": "scatter",
    "c10d.barrier": "barrier",
    "c10d.send": "send",
    "c10d.recv_": "recv",
    "c10d.recv_any_source_": "recv",
}


def op_name(func: Any) -> str:
    """``"namespace.name"`` of an operator overload's packet, e.g. ``"aten.copy_"`` for
    ``aten.copy_.default`` (``str(func)`` for anything else)."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)


def is_copy_kernel(name: str) -> bool:
    """Whether ``name`` (as :func:`op_name` gives it) is a copy kernel: in :data:`COPY_KERNELS`,
    or an aten operator named ``*_copy`` or ``*_scatter`` (or their in-place ``*_``)."""
    if name in COPY_KERNELS:
        return True
    namespace, _, base = name.partition(".")
    return namespace == "aten" and base.endswith(_COPY_SUFFIXES)


def is_classified(name: str) -> bool:
    """Whether :func:`is_copy_kernel` knows ``name``: an operator of a namespace classified by
    rule (aten, the collectives, profiler markers), or a custom operator named in
    :data:`COPY_KERNELS` or :data:`NON_COPY_CUSTOM_OPS`. One that is not could copy unseen."""
    namespace = name.partition(".")[0]
    return namespace in _RULE_NAMESPACES or name in COPY_KERNELS or name in NON_COPY_CUSTOM_OPS


def collective_kind(name: str) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``,
    ``"broadcast"``, ... for a c10d or functional-collective operator name; None otherwise."""
    return _COLLECTIVE_KINDS.get(name)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective issued under a :class:`CountingMode`.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ...
        op: the operator name, e.g. ``"c10d._allgather_base_"``.
        ranks: global ranks of its process group, in group order.
        nbytes: bytes of its largest tensor argument (the unsharded side: an all-gather's
            output, a reduce-scatter's input, an all-reduce's tensor); for a coalesced
            collective, the sum over its list of tensors; for an all-to-all carrying a
            gradient reduce-scatter or a parameter all-gather, the unsharded side (what it
            sends plus the share it keeps or receives).
        dtype: dtype of that tensor (None when it had no tensor).
        purpose: what it was issued for (:func:`collective_purpose`), or None.
        sent_bytes: for an all-to-all, the bytes this rank sends to the other ranks (its
            input less what its split sizes keep for itself); None for other kinds.
    """

    kind: str
    op: str
    ranks: tuple[int, ...]
    nbytes: int
    dtype: torch.dtype | None
    purpose: str | None = None
    sent_bytes: int | None = None

    @property
    def group_size(self) -> int:
        """Ranks in its process group."""
        return len(self.ranks)

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends under a bandwidth-optimal algorithm (ring or equivalent):
        ``(n - 1) / n * nbytes`` for an all-gather, reduce-scatter or all-to-all, twice that
        for an all-reduce, ``nbytes`` for anything else (broadcast, point to point); what it
        sends to the others for an all-to-all whose split sizes are known (``sent_bytes``:
        the same for an even split, and exact for one that keeps nothing for itself)."""
        if self.sent_bytes is not None:
            return float(self.sent_bytes)
        n = max(self.group_size, 1)
        share = (n - 1) / n * self.nbytes
        if self.kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return share
        if self.kind == "all_reduce":
            return 2 * share
        return float(self.nbytes)


def _resolve_process_group(name: str) -> Any:
    """The process group a functional collective names (torch keeps the resolver private)."""
    from torch.distributed import distributed_c10d

    resolve: Callable[[Any], Any] = distributed_c10d._resolve_process_group  # type: ignore[attr-defined]
    return resolve(name)


def _process_group_ranks(args: Iterable[Any]) -> tuple[int, ...]:
    """Global ranks of the process group among an operator's (flattened) arguments."""
    for arg in args:
        group: Any = None
        if isinstance(arg, torch.ScriptObject):
            if arg._type().qualified_name().endswith("ProcessGroup"):
                group = dist.ProcessGroup.unbox(arg)
        elif isinstance(arg, dist.ProcessGroup):
            group = arg
        elif isinstance(arg, str) and arg:
            # Functional collectives name their group.
            try:
                group = _resolve_process_group(arg)
            except (RuntimeError, ValueError, KeyError):
                group = None
        if group is not None:
            return tuple(dist.get_process_group_ranks(group))
    return ()


def _all_to_all_bytes(arguments: Any, ranks: tuple[int, ...]) -> tuple[int, int] | None:
    """``(sent, share)`` of an ``alltoall_base_`` (``output, input, group,
    output_split_sizes, input_split_sizes, ...``): the bytes it sends to the other ranks (its
    input less the rows its input split sizes give this rank; an even split when they are
    empty) and the largest share one rank receives from it. None when the arguments are not
    laid out so, or this rank is not in ``ranks``."""
    args = arguments[0]
    me = dist.get_rank() if dist.is_initialized() else -1
    if len(args) < 5 or not isinstance(args[1], torch.Tensor) or me not in ranks:
        return None
    source, splits = args[1], [int(k) for k in args[4]]
    total = source.numel() * source.element_size()
    if source.dim() == 0 or source.shape[0] == 0:
        return total, total
    row = total // source.shape[0]
    splits = splits or [source.shape[0] // len(ranks)] * len(ranks)
    return total - splits[ranks.index(me)] * row, max(splits) * row


def _largest_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)


class CountingMode(TorchDispatchMode):
    """Counts the operators and collectives run under it (a context manager).

    Attributes:
        ops: operator name -> calls made by the code under the mode (names as :func:`op_name`
            gives them; collectives included, e.g. ``"c10d._reduce_scatter_base_"``).
        backend_ops: operator name -> calls made inside ``Work.wait`` of a collective
            (backend internals; see the module docstring). Empty with ``attribute_waits=False``,
            where those calls count in ``ops``.
        collectives: every collective issued, in order.

    Args:
        attribute_waits: count operators run inside ``torch.distributed.Work.wait`` in
            ``backend_ops`` (the method is wrapped while the mode is active, then restored;
            nothing is wrapped where torch has no distributed support).
    """

    def __init__(self, *, attribute_waits: bool = True) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self.ops: Counter[str] = Counter()
        self.backend_ops: Counter[str] = Counter()
        self.collectives: list[CollectiveCall] = []
        self._attribute_waits = attribute_waits
        self._waiting = threading.local()
        self._saved_waits: list[Callable[..., Any]] = []

    # Context manager ---------------------------------------------------------------------

    def __enter__(self) -> CountingMode:
        if self._attribute_waits and dist.is_available():
            self._wrap_wait()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]
        finally:
            if self._saved_waits:
                dist.Work.wait = self._saved_waits.pop()  # type: ignore[method-assign]

    def _wrap_wait(self) -> None:
        original: Callable[..., Any] = dist.Work.wait
        self._saved_waits.append(original)
        waiting = self._waiting

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            waiting.depth = getattr(waiting, "depth", 0) + 1
            try:
                return original(work, *args, **kwargs)
            finally:
                waiting.depth -= 1

        dist.Work.wait = wait  # type: ignore[method-assign,assignment]

    # Dispatch ----------------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = op_name(func)
        if getattr(self._waiting, "depth", 0) > 0:
            self.backend_ops[name] += 1
        else:
            self.ops[name] += 1
        kind = collective_kind(name)
        if kind is not None:
            self._record(kind, name, (args, kwargs))
        return func(*args, **kwargs)

    def _record(self, kind: str, name: str, arguments: Any) -> None:
        flat = tree_flatten(arguments)[0]
        largest = _largest_tensor(flat)
        nbytes = 0 if largest is None else largest.numel() * largest.element_size()
        if "coalesced" in name:
            # One collective over a list of tensors: it moves all of them.
            first = arguments[0][0] if arguments[0] else []
            tensors = [t for t in tree_flatten(first)[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
        ranks = _process_group_ranks(flat)
        purpose = current_purpose()
        sent = None
        if kind == "all_to_all" and name.endswith("alltoall_base_"):
            found = _all_to_all_bytes(arguments, ranks)
            if found is not None:
                sent, share = found
                if purpose in ("grad_reduce_scatter", "param_all_gather"):
                    # The unsharded side, as for a reduce-scatter or an all-gather, also when
                    # the rank keeps its own chunk out of the exchange (hp_fsdp._collectives).
                    nbytes = sent + share
        self.collectives.append(
            CollectiveCall(
                kind=kind,
                op=name,
                ranks=ranks,
                nbytes=nbytes,
                dtype=None if largest is None else largest.dtype,
                purpose=purpose,
                sent_bytes=sent,
            )
        )

    # Queries -----------------------------------------------------------------------------

    def select(self, names: Iterable[str]) -> Counter[str]:
        """Calls (by the code under the mode) of the operators in ``names``."""
        wanted = frozenset(names)
        return Counter({n: c for n, c in self.ops.items() if n in wanted})

    def copies(self) -> Counter[str]:
        """Copy kernels (:func:`is_copy_kernel`) run by the code under the mode, by operator."""
        return Counter({n: c for n, c in self.ops.items() if is_copy_kernel(n)})

    def unclassified(self) -> Counter[str]:
        """Operators run by the code under the mode that :func:`is_copy_kernel` cannot judge
        (custom operators not named in :data:`COPY_KERNELS` or :data:`NON_COPY_CUSTOM_OPS`):
        empty, or a copy count means nothing."""
        return Counter({n: c for n, c in self.ops.items() if not is_classified(n)})

    @property
    def copy_count(self) -> int:
        """Total copy kernels run by the code under the mode (backend internals excluded)."""
        return sum(self.copies().values())

    def backend_copies(self) -> Counter[str]:
        """Copy kernels run inside collectives' waits (the communication backend's own)."""
        return Counter({n: c for n, c in self.backend_ops.items() if is_copy_kernel(n)})

    def fills(self) -> Counter[str]:
        """Constant fills (zeros) by operator."""
        return self.select(FILL_KERNELS)

    def inplace_adds(self) -> Counter[str]:
        """In-place additions by operator."""
        return self.select(INPLACE_ADD_KERNELS)

    def collective_counts(self, kinds: Iterable[str] | None = None) -> Counter[tuple[str, int]]:
        """``(kind, group size) -> calls``, optionally only for ``kinds``."""
        wanted = None if kinds is None else frozenset(kinds)
        return Counter(
            (c.kind, c.group_size) for c in self.collectives if wanted is None or c.kind in wanted
        )

    def collectives_over(self, ranks: Iterable[int]) -> list[CollectiveCall]:
        """The collectives whose process group is exactly ``ranks`` (as a set): e.g. this rank's
        shard group or replicate group of an HSDP mesh, even when both have the same size."""
        wanted = frozenset(ranks)
        return [c for c in self.collectives if frozenset(c.ranks) == wanted]

    def bytes_by(
        self, key: str = "purpose", ranks: Iterable[int] | None = None, *, wire: bool = True
    ) -> dict[str, float]:
        """Bytes of the collectives by ``key`` (``"purpose"``, untagged ones under their kind,
        or ``"kind"``), only those over exactly ``ranks`` (as a set) when given; wire bytes
        (:attr:`CollectiveCall.wire_bytes`), or with ``wire=False`` the unsharded side."""
        if key not in ("purpose", "kind"):
            raise ValueError(f"bytes_by groups by 'purpose' or 'kind', got {key!r}")
        calls = self.collectives if ranks is None else self.collectives_over(ranks)
        out: dict[str, float] = {}
        for c in calls:
            name = (c.purpose or c.kind) if key == "purpose" else c.kind
            out[name] = out.get(name, 0.0) + (c.wire_bytes if wire else c.nbytes)
        return out

    def summary(self) -> dict[str, Any]:
        """Picklable digest: ``ops``, ``backend_ops``, ``copies``, ``copy_count``,
        ``unclassified``, ``fills``, ``inplace_adds`` (name -> calls) and ``collectives``
        (``"kind/group size"`` -> calls)."""
        return {
            "ops": dict(self.ops),
            "backend_ops": dict(self.backend_ops),
            "copies": dict(self.copies()),
            "copy_count": self.copy_count,
            "unclassified": dict(self.unclassified()),
            "fills": dict(self.fills()),
            "inplace_adds": dict(self.inplace_adds()),
            "collectives": {f"{k}/{n}": c for (k, n), c in self.collective_counts().items()},
        }


class PeakMemoryMode(TorchDispatchMode):
    """Peak bytes of live tensor storage while the code under it runs (a context manager)::

        with PeakMemoryMode() as memory:
            model(batch).sum().backward()
        memory.peak_increase  # bytes above what was live on entry, at the worst moment

    Method. On entry, the storages of every tensor reachable from Python (``gc.get_objects``)
    are recorded; after every operator, the storages of its tensor arguments and results too.
    A recorded storage is live while anything besides this mode holds it: torch's reference
    count of the storage (``torch._C._storage_Use_Count``) is above the one reference the mode
    keeps. After every operator the current sizes (``nbytes``) of the live storages are summed,
    each storage once however many views share it; sizes are read at every sample, so a
    ``storage.resize_`` (how FSDP frees and re-allocates unsharded parameters, outside the
    dispatcher) shows at the next operator. This is the memory the tensors hold, on any device
    (CPU included: it needs no allocator statistics), not what the allocator reserved.

    Tensor subclasses that wrap others (``DTensor``) have no storage of their own and count
    through the tensors they wrap. Not seen: memory an operator allocates and frees inside
    itself (a kernel's scratch, the kernels inside a custom operator), buffers of other threads
    that never reach the dispatcher in this thread (a communication backend's own), and
    storages held only by C++ from before entry. The mode holds each storage it saw until the
    next operator finds it otherwise unused, so memory returns to the allocator up to one
    operator later than it would; the sums are unaffected.

    Attributes:
        start_bytes: live bytes on entry.
        peak_bytes: the largest sum, over the entry and every operator.
        end_bytes: live bytes on exit.
        peak_op: the operator after which the peak was reached ("" for the entry).
        samples: operators sampled.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.start_bytes = 0
        self.peak_bytes = 0
        self.end_bytes = 0
        self.peak_op = ""
        self.samples = 0

    @property
    def peak_increase(self) -> int:
        """``peak_bytes - start_bytes``."""
        return self.peak_bytes - self.start_bytes

    def _track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
            # A wrapper subclass (DTensor) has a placeholder storage sized like its global
            # shape and no data; its inner tensors are what holds memory.
            storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        self._storages.setdefault(storage._cdata, storage)

    def live_bytes(self) -> int:
        """Bytes of the recorded storages still in use elsewhere (forgetting the others)."""
        use_count = torch._C._storage_Use_Count  # private: torch exposes no public use count
        total = 0
        dead = []
        for key, storage in self._storages.items():
            if use_count(key) <= 1:
                dead.append(key)
            else:
                total += storage.nbytes()
        for key in dead:
            del self._storages[key]
        return total

    def __enter__(self) -> PeakMemoryMode:
        # Unreachable cycles would be collected at an arbitrary point of the measured code.
        gc.collect()
        for obj in gc.get_objects():
            # type(), not isinstance: isinstance reads __class__, which some module proxies warn on.
            if issubclass(type(obj), torch.Tensor):
                self._track(obj)
        self.start_bytes = self.peak_bytes = self.live_bytes()
        self.peak_op, self.samples = "", 0
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]
        self.end_bytes = self.live_bytes()
        self._storages.clear()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs, out))[0]:
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        self.samples += 1
        live = self.live_bytes()
        if live > self.peak_bytes:
            self.peak_bytes, self.peak_op = live, op_name(func)
        return out


def extra_counts(step: Mapping[str, int], baseline: Mapping[str, int]) -> dict[str, int]:
    """``step - baseline`` per operator, keeping only the non-zero differences (positive: the
    step ran more of that operator; negative: fewer)."""
    names = set(step) | set(baseline)
    diff = {n: step.get(n, 0) - baseline.get(n, 0) for n in sorted(names)}
    return {n: d for n, d in diff.items() if d != 0}
