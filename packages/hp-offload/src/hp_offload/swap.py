"""Activation swapping: saved activations live in host memory between forward and backward.

:func:`swap_wrapper` wraps a module (in place) so that the tensors autograd saves during its
forward are copied into host buffers and copied back before its backward needs them. A
:class:`Swapper` shared by the wrapped layers owns

* a :class:`HostBufferPool`: host buffers keyed by ``(numel, dtype)``, reused across tensors
  and steps (pinned when an accelerator is available, pageable on a CPU-only machine);
* one side stream (from ``torch.accelerator``; none on the CPU, where copies are synchronous)
  on which every device-to-host and host-to-device copy runs, so copies of one buffer are
  ordered by the stream;
* the prefetch chain: when layer ``i``'s backward starts (the first gradient of one of its
  outputs is ready) the swapper starts fetching layer ``i``'s and layer ``i-1``'s tensors, so
  layer ``i-1``'s copies overlap layer ``i``'s backward.

Stream safety (accelerator): an offload copy starts after the compute stream's work so far
(``wait_stream``); the device tensor is kept referenced until the compute stream has waited on
the copy's event, so the allocator cannot hand its memory out while the copy reads it. A fetch
allocates on the compute stream, the side stream waits on an event recorded after the
allocation, and the compute stream waits on the copy's event before backward uses the tensor.

Not swapped (kept on the device as autograd would keep them): tensors below ``min_bytes``;
tensors that share storage with a parameter or buffer of the wrapped module (e.g. the
transposed weight a linear saves), with a leaf that requires grad, or with a tensor argument of
the forward that requires no grad (rotary tables, masks, token ids): another owner keeps those
alive, so a copy would free nothing; non-contiguous views of a storage more than
``max_storage_ratio`` times their own size (the whole storage is what would be copied).

What is copied is a contiguous tensor's own bytes when its storage is larger (a piece of a
split, such as one expert's rows of an MoE layer's dispatched tokens: the pieces together are
the storage, copied once), once per view and layer call, and it comes back as a tensor of its
own with the same shape and strides. Otherwise a tensor's whole storage is copied, once per
storage and layer call however many views of it autograd saves, and backward gets views with
the original shape, strides and offset over one fetched storage. Either way the bytes (and the
kernels' results) are exactly those of the unwrapped run.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hp_offload.memory as memory

__all__ = [
    "HostBufferPool",
    "SwapGroup",
    "SwapRecord",
    "SwappedTensor",
    "Swapper",
    "swap_wrapper",
    "unwrap",
]

_WRAPPED_ATTR = "_hp_offload_wrapped"


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostBufferPool:
    """Flat host buffers keyed by ``(numel, dtype)``, handed out and returned.

    Postconditions: :meth:`acquire` returns a 1-D host tensor of exactly ``numel`` elements,
    reused from a returned buffer when one of that key is free; :attr:`allocations` counts the
    buffers ever created, :attr:`reuses` the acquisitions served from the pool.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.allocations = 0
        self.reuses = 0
        self.allocated_bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A free buffer of ``numel`` elements of ``dtype``."""
        free = self._free.get((numel, dtype))
        if free:
            self.reuses += 1
            return free.pop()
        self.allocations += 1
        buf = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return ``buf`` to the pool (the caller guarantees no copy into or out of it is
        pending outside the swapper's stream order)."""
        self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def clear(self) -> None:
        """Drop every free buffer."""
        self._free.clear()


class SwapRecord:
    """One swapped storage: its host copy, and its device copy once fetched."""

    __slots__ = (
        "__weakref__",
        "device",
        "fetch_event",
        "fetched",
        "group",
        "host",
        "host_token",
        "nbytes",
        "offload_event",
        "original",
        "original_token",
        "token",
    )

    def __init__(self, nbytes: int, device: torch.device, group: SwapGroup) -> None:
        self.nbytes = nbytes
        self.device = device
        self.group = group
        self.host: torch.Tensor | None = None
        self.host_token: memory.Token | None = None
        self.original: torch.Tensor | None = None
        self.original_token: memory.Token | None = None
        self.offload_event: torch.Event | None = None
        self.fetched: torch.Tensor | None = None
        self.fetch_event: torch.Event | None = None
        self.token: memory.Token | None = None


class SwappedTensor:
    """A saved tensor whose storage was swapped: the record plus the view's geometry."""

    __slots__ = ("dtype", "offset", "record", "shape", "stride")

    def __init__(self, t: torch.Tensor, record: SwapRecord, alone: bool = False) -> None:
        self.record = record
        self.dtype = t.dtype
        self.shape, self.stride = t.shape, t.stride()
        # A view copied alone starts its record's bytes.
        self.offset = 0 if alone else t.storage_offset()


class SwapGroup:
    """The records of one wrapped layer call, and a weak link to the call before it."""

    def __init__(self, previous: SwapGroup | None, meter: memory.ActivationMeter | None) -> None:
        self.records: list[weakref.ref[SwapRecord]] = []
        self.previous = weakref.ref(previous) if previous is not None else None
        self.meter = meter
        self.fetch_started = False
        self.external: set[int] = set()
        # storage -> record during the layer's forward; holding the storage keeps its address
        # from being reused by another tensor before the forward ends (cleared at its end).
        self.seen: dict[tuple[int, int, bool], tuple[torch.UntypedStorage, SwapRecord]] = {}


class Swapper:
    """Moves saved activations to host memory and back; shared by the layers it wraps.

    Args:
        min_bytes: tensors smaller than this stay on the device (default 64 KiB).
        pool: the host buffer pool (default: a new one, pinned iff an accelerator is
            available).
        device: the accelerator device the activations live on (default: the current
            accelerator, or ``cpu`` when there is none). On ``cpu`` the copies are
            synchronous and no stream is used.
        max_storage_ratio: a saved non-contiguous view is swapped (with its whole storage,
            so views share it again in backward) only if the storage is at most this many
            times its own bytes; contiguous views are copied alone.
    """

    def __init__(
        self,
        min_bytes: int = 1 << 16,
        pool: HostBufferPool | None = None,
        device: torch.device | str | None = None,
        max_storage_ratio: float = 2.0,
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if device is None:
            acc = (
                torch.accelerator.current_accelerator()
                if torch.accelerator.is_available()
                else None
            )
            device = acc if acc is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.asynchronous = self.device.type != "cpu"
        if self.asynchronous and not torch.accelerator.is_available():
            raise ValueError(f"device {self.device} given but no accelerator is available")
        self.pool = pool if pool is not None else HostBufferPool(pin_memory=self.asynchronous)
        self.min_bytes = min_bytes
        self.max_storage_ratio = max_storage_ratio
        self.stream: torch.Stream | None = (
            torch.Stream(device=self.device) if self.asynchronous else None
        )
        self._last_group: weakref.ref[SwapGroup] | None = None
        self._in_flight: list[SwapRecord] = []
        self.swapped_bytes = 0
        self.kept_bytes = 0

    # ---- groups -------------------------------------------------------------------------

    def begin_group(self, module: nn.Module | None = None, inputs: object = ()) -> SwapGroup:
        """Start the records of one layer call (call at the layer's forward start), with the
        storages of ``module``'s parameters and buffers and of the tensors in ``inputs`` that
        require no grad marked external (never swapped)."""
        last = self._last_group() if self._last_group is not None else None
        previous = last if last is not None and not last.fetch_started else None
        group = SwapGroup(previous, memory.active_meter())
        external = [t for t in _tensors(inputs) if not t.requires_grad]
        if module is not None:
            external += [*module.parameters(), *module.buffers()]
        group.external = {t.untyped_storage().data_ptr() for t in external}
        self._last_group = weakref.ref(group)
        return group

    def end_group(self, group: SwapGroup, outputs: object) -> None:
        """Finish a layer call: retire older in-flight offloads, and arm the prefetch that
        fires when the first gradient of one of ``outputs`` is computed."""
        group.seen.clear()
        self._retire(keep=group)
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if not tensors:
            return
        ref = weakref.ref(group)

        def on_backward(_: object) -> None:
            g = ref()
            if g is None:
                return
            self.fetch(g)
            prev = g.previous() if g.previous is not None else None
            if prev is not None:
                self.fetch(prev)

        torch.autograd.graph.register_multi_grad_hook(tensors, on_backward, mode="any")

    # ---- per tensor ---------------------------------------------------------------------

    @staticmethod
    def _alone(t: torch.Tensor) -> bool:
        """Whether ``t`` is copied alone: contiguous, and smaller than its storage."""
        return t.is_contiguous() and t.untyped_storage().nbytes() > t.numel() * t.element_size()

    def should_swap(self, t: torch.Tensor, group: SwapGroup) -> bool:
        """The rule of the module docstring: large enough, not external, not a leaf that
        requires grad, on the swapper's device, contiguous or a view of at least
        ``1/max_storage_ratio`` of its storage."""
        return (
            t.numel() * t.element_size() >= max(self.min_bytes, 1)
            and not (t.is_leaf and t.requires_grad)
            and t.device == self.device
            and t.untyped_storage().data_ptr() not in group.external
            and (
                self._alone(t)
                or t.untyped_storage().nbytes()
                <= self.max_storage_ratio * t.numel() * t.element_size()
            )
        )

    def offload(self, t: torch.Tensor, group: SwapGroup) -> SwappedTensor:
        """Copy ``t``'s whole storage (or, for a contiguous view of a larger storage, its own
        bytes) into a pooled host buffer (on the side stream when asynchronous), once per
        storage (view) and layer call (the storage is held until the call's
        :meth:`end_group`)."""
        storage = t.untyped_storage()
        alone = self._alone(t)
        if alone:
            nbytes = t.numel() * t.element_size()
            key = (t.data_ptr(), nbytes, True)
            src = t.detach().reshape(-1).view(torch.uint8)
        else:
            key = (storage.data_ptr(), storage.nbytes(), False)
            src = _bytes_of(storage, t.device)
        seen = group.seen.get(key)
        if seen is not None:
            return SwappedTensor(t, seen[1], alone)
        rec = SwapRecord(src.numel(), t.device, group)
        buf = self.pool.acquire(rec.nbytes, torch.uint8)
        if self.stream is not None:
            compute = torch.accelerator.current_stream(self.device)
            self.stream.wait_stream(compute)
            with self.stream:
                buf.copy_(src, non_blocking=True)
                rec.offload_event = self.stream.record_event()
            rec.original = src
            if group.meter is not None:
                rec.original_token = group.meter.hold(src, "device")
            self._in_flight.append(rec)
        else:
            buf.copy_(src)
        rec.host = buf
        if group.meter is not None:
            rec.host_token = group.meter.hold(buf, "host")
        group.records.append(weakref.ref(rec))
        group.seen[key] = (storage, rec)
        self.swapped_bytes += rec.nbytes
        return SwappedTensor(t, rec, alone)

    def _retire(self, keep: SwapGroup | None = None) -> None:
        """Drop device originals whose offload copy the compute stream has waited on."""
        if self.stream is None:
            return
        compute = torch.accelerator.current_stream(self.device)
        still: list[SwapRecord] = []
        for rec in self._in_flight:
            if rec.group is keep:
                still.append(rec)
                continue
            self._retire_one(rec, compute)
        self._in_flight = still

    @staticmethod
    def _retire_one(rec: SwapRecord, compute: torch.Stream) -> None:
        if rec.offload_event is not None:
            compute.wait_event(rec.offload_event)
            rec.offload_event = None
        rec.original = None
        if rec.original_token is not None:
            rec.original_token.release()
            rec.original_token = None

    def fetch(self, group: SwapGroup) -> None:
        """Start copying every record of ``group`` back to the device (idempotent)."""
        group.fetch_started = True
        for ref in group.records:
            rec = ref()
            if rec is not None and rec.fetched is None:
                self._fetch_one(rec)

    def _fetch_one(self, rec: SwapRecord) -> None:
        assert rec.host is not None
        view = rec.host
        dev = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)
        if self.stream is not None:
            compute = torch.accelerator.current_stream(self.device)
            if rec.original is not None:  # offload not retired yet: the original is still here
                self._retire_one(rec, compute)
                self._in_flight = [r for r in self._in_flight if r is not rec]
            self.stream.wait_event(compute.record_event())
            with self.stream:
                dev.copy_(view, non_blocking=True)
                rec.fetch_event = self.stream.record_event()
        else:
            dev.copy_(view)
        # Every copy into or out of a host buffer runs on the one side stream (or
        # synchronously), so the buffer can serve a later offload at once.
        self.pool.release(rec.host)
        rec.host = None
        if rec.host_token is not None:
            rec.host_token.release()
            rec.host_token = None
        rec.fetched = dev
        if rec.group.meter is not None:
            rec.token = rec.group.meter.hold(dev, "device")

    def get(self, packed: SwappedTensor) -> torch.Tensor:
        """The swapped tensor back on the device, ready for the compute stream.

        Postcondition: bit-equal to the offloaded tensor, with the same shape, strides and
        storage offset; tensors of one storage come back sharing one storage.
        """
        rec = packed.record
        if rec.fetched is None:
            self.fetch(rec.group)
        assert rec.fetched is not None
        if rec.fetch_event is not None:
            torch.accelerator.current_stream(self.device).wait_event(rec.fetch_event)
            rec.fetch_event = None
        out = torch.empty(0, dtype=packed.dtype, device=rec.device)
        with torch.no_grad():
            out.set_(rec.fetched.untyped_storage(), packed.offset, packed.shape, packed.stride)
        return out

    # ---- saved-tensor hooks -------------------------------------------------------------

    def pack(self, group: SwapGroup, t: torch.Tensor) -> object:
        """Pack hook: a :class:`SwappedTensor` for a swapped tensor, else ``(t, token)``."""
        if self.should_swap(t, group):
            return self.offload(t, group)
        self.kept_bytes += t.numel() * t.element_size()
        return (t, group.meter.hold(t, "device") if group.meter is not None else None)

    def unpack(self, packed: object) -> torch.Tensor:
        """Unpack hook matching :meth:`pack`."""
        if isinstance(packed, SwappedTensor):
            return self.get(packed)
        assert isinstance(packed, tuple)
        t: torch.Tensor = packed[0]
        return t


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def mark_wrapped(module: nn.Module, kind: str, forward: Callable[..., Any]) -> None:
    """Replace ``module.forward`` on the instance (hooks of ``module.__call__`` still run
    around it) and remember the original; raise if the module is already wrapped."""
    if getattr(module, _WRAPPED_ATTR, None) is not None:
        raise ValueError(
            f"{type(module).__name__} is already wrapped ({getattr(module, _WRAPPED_ATTR)[0]}); "
            f"call hp_offload.unwrap(module) first"
        )
    # A forward set on the instance (e.g. a tensor-parallel style's production forward) is
    # what unwrap must bring back; otherwise the class's forward is.
    own = module.__dict__.get("forward")
    setattr(module, _WRAPPED_ATTR, (kind, own))
    module.forward = types.MethodType(lambda self, *a, **k: forward(*a, **k), module)


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`swap_wrapper` / ``checkpoint_wrapper`` on ``module`` (in place)."""
    wrapped = getattr(module, _WRAPPED_ATTR, None)
    if wrapped is None:
        raise ValueError(f"{type(module).__name__} is not wrapped by hp_offload")
    own = wrapped[1]
    if own is None:
        del module.forward
    else:
        module.forward = own
    delattr(module, _WRAPPED_ATTR)
    return module


def swap_wrapper(module: nn.Module, swapper: Swapper | None = None) -> nn.Module:
    """Swap the activations ``module``'s forward saves to host memory (in place).

    Postconditions: ``module`` is returned, its state dict and type unchanged; each forward
    runs under saved-tensor hooks that offload the tensors :meth:`Swapper.should_swap`
    selects, and backward gets bit-equal tensors back. Share one ``swapper`` among the
    layers of a model so prefetch chains layer ``i-1`` behind layer ``i``.
    """
    sw = swapper if swapper is not None else Swapper()
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        group = sw.begin_group(module, (args, kwargs))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sw.pack(group, t), sw.unpack):
            out = original(*args, **kwargs)
        sw.end_group(group, out)
        return out

    mark_wrapped(module, "swap", forward)
    return module
