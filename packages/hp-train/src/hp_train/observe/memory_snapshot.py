"""``--memory-snapshot``: what holds memory during chosen training steps.

A :class:`MemorySnapshot` watches the steps it is given on one rank (``step_begin(n)`` before
step ``n``, ``step_end(n)`` after it) and measures them in one of two ways:

* **Allocator snapshot**, on an accelerator whose device module records the caching
  allocator's history (``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``, found
  through ``torch.get_device_module``): every allocation of the step with its stack, written
  as ``<out_dir>/memory/rank_<r>_step_<n>.pickle`` (drag it onto
  https://pytorch.org/memory_viz). The figures are the allocator's own: bytes allocated to
  tensors at the step's start, end and peak, and the peak reserved by the allocator.
* **Live tensors**, everywhere else (CPU): tensor-level accounting by a dispatch mode
  (:class:`TensorAccounting`), written as ``<out_dir>/memory/rank_<r>_step_<n>.json``. The
  peak is the largest sum, after any operator of the step, of the bytes of the tensor storages
  alive then, each storage once however many views or tensors share it, split by what holds
  each storage at that moment: the model's parameters (and buffers), their gradients, the
  optimizer's state, and everything else (activations, temporaries, the batch).

The process's peak resident set (``rss_peak_bytes``, from ``getrusage``: the whole process,
since it started, never reset) is reported beside them on CPU, labelled as what it is: it
includes the interpreter, libraries and allocator slack, so the live-tensor figures are what
compare memory-saving techniques.

What the live-tensor accounting sees: the parameters, buffers, gradients and optimizer state
when the step begins, and every tensor an operator of the step reads or writes (at the
dispatcher, on this thread). It does not see memory a kernel allocates and frees inside itself,
a communication backend's own buffers, or tensors the step never touches; wrapper tensors
(DTensors) count through the local tensors they hold.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hp_train.observe.metrics import peak_memory_bytes

__all__ = [
    "CATEGORIES",
    "MemorySnapshot",
    "TensorAccounting",
    "format_memory",
    "snapshot_path",
]

#: The live-tensor categories, in precedence order (a storage that is both a parameter and
#: something else counts as a parameter), -> the figure's key.
CATEGORIES: Mapping[str, str] = {
    "parameters": "live_parameters_bytes",
    "gradients": "live_gradients_bytes",
    "optimizer_state": "live_optimizer_state_bytes",
    "activations": "live_activations_bytes",
}

#: Every figure's key -> its label in :func:`format_memory`'s line, in the line's order.
_LABELS: Mapping[str, str] = {
    "live_tensors_peak_bytes": "live tensors peak",
    "live_parameters_bytes": "parameters",
    "live_gradients_bytes": "gradients",
    "live_optimizer_state_bytes": "optimizer state",
    "live_activations_bytes": "activations and temporaries",
    "live_tensors_start_bytes": "live tensors at step start",
    "live_tensors_end_bytes": "at step end",
    "device_allocated_peak_bytes": "device allocated peak",
    "device_allocated_start_bytes": "at step start",
    "device_allocated_end_bytes": "at step end",
    "device_reserved_peak_bytes": "device reserved peak",
    "rss_peak_bytes": "process RSS peak since start",
}
_SPLIT = frozenset(CATEGORIES.values())


def snapshot_path(out_dir: Path, rank: int, step: int, suffix: str) -> Path:
    """Where the record of ``step`` (1-based) on ``rank`` is written (``suffix``: ``.json``
    or ``.pickle``)."""
    return Path(out_dir) / "memory" / f"rank_{rank}_step_{step}{suffix}"


def _size(n: int) -> str:
    if abs(n) < 1024:
        return f"{n} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if abs(n) < 1024 * scale or unit == "GiB":
            return f"{n / scale:.1f} {unit}"
    raise AssertionError("unreachable")


def format_memory(figures: Mapping[str, int]) -> str:
    """One log line of ``figures`` (as :meth:`MemorySnapshot.step_end` gives them): every
    figure with its label and size in B / KiB / MiB / GiB, the four live-tensor categories in
    parentheses after the live-tensor peak they split; figures of unknown keys last, under
    their key.

    Raises:
        ValueError: ``figures`` empty, or a figure that is not an int.
    """
    if not figures:
        raise ValueError("no memory figures to format")
    for key, value in figures.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"memory figure {key!r} must be an int of bytes, got {value!r}")
    parts: list[str] = []
    split = [f"{_LABELS[k]} {_size(figures[k])}" for k in _LABELS if k in _SPLIT and k in figures]
    for key, label in _LABELS.items():
        if key in figures and key not in _SPLIT:
            text = f"{label} {_size(figures[key])}"
            if key == "live_tensors_peak_bytes" and split:
                text += f" ({', '.join(split)})"
            parts.append(text)
    if split and "live_tensors_peak_bytes" not in figures:
        parts.insert(0, ", ".join(split))
    parts += [f"{k} {_size(v)}" for k, v in figures.items() if k not in _LABELS]
    return "memory: " + "; ".join(parts)


def _local_tensors(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors holding ``t``'s data (``t`` itself, or a wrapper's inner ones)."""
    wrapper: object = t  # typed as object: torch types the check as a Tensor-free protocol
    if is_traceable_wrapper_subclass(wrapper):
        for name in wrapper.__tensor_flatten__()[0]:
            yield from _local_tensors(getattr(wrapper, name))
    elif type(t) is not torch.Tensor and type(t) is not nn.Parameter and hasattr(t, "to_local"):
        # A DTensor of hp_dtensor: its data is the rank's local shard.
        with torch.no_grad():
            yield from _local_tensors(t.to_local())
    else:
        yield t


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()  # a wrapper's placeholder storage has no data: raises
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage


def _keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    keys: set[int] = set()
    for t in tensors:
        for local in _local_tensors(t):
            storage = _storage(local)
            if storage is not None:
                keys.add(storage._cdata)
    return keys


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


@dataclass(frozen=True)
class Peak:
    """The moment of the largest live-tensor sum.

    Attributes:
        total: bytes alive then.
        split: bytes by category (keys of :data:`CATEGORIES`); sums to ``total``.
        op: the operator after which it was reached (``"<step start>"`` before any).
        largest: the largest storages then: ``(bytes, category, the operator after which the
            accounting first saw it)``.
    """

    total: int
    split: Mapping[str, int]
    op: str
    largest: tuple[tuple[int, str, str], ...]


class TensorAccounting(TorchDispatchMode):
    """Live-tensor bytes of ``model`` and ``optimizer``'s step, by category (a context
    manager around the step).

    A storage is alive while anything besides this mode holds it (torch's reference count of
    the storage is above the mode's own one). After every operator, the bytes of the alive
    storages are summed (each storage once, at its current size); when the sum is a new peak,
    each storage is classified by what holds it at that moment: a parameter or buffer of
    ``model``, a gradient of a parameter, a tensor of ``optimizer.state``, or none of them.

    Postconditions after the ``with`` block: :attr:`start` and :attr:`end` are the bytes alive
    on entry and exit, :attr:`peak` the largest moment (entry included).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        self._model = model
        self._optimizer = optimizer
        self._storages: dict[int, tuple[torch.UntypedStorage, str]] = {}
        self._parameter_keys: set[int] = set()
        self.start = 0
        self.end = 0
        self.peak = Peak(0, dict.fromkeys(CATEGORIES, 0), "<step start>", ())

    def _track(self, tensors: Iterable[object], op: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for local in _local_tensors(t):
                    storage = _storage(local)
                    if storage is not None:
                        self._storages.setdefault(storage._cdata, (storage, op))

    def _alive(self) -> int:
        """Bytes of the tracked storages held elsewhere (forgetting those that are not)."""
        use_count = torch._C._storage_Use_Count  # private: torch has no public use count
        total = 0
        for key in list(self._storages):
            if use_count(key) <= 1:
                del self._storages[key]
            else:
                total += self._storages[key][0].nbytes()
        return total

    def _roots(self) -> list[torch.Tensor]:
        params = list(self._model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return [*params, *self._model.buffers(), *grads, *_state_tensors(self._optimizer)]

    def _classify(self, total: int, op: str) -> Peak:
        grad_keys = _keys(p.grad for p in self._model.parameters() if p.grad is not None)
        state_keys = _keys(_state_tensors(self._optimizer))
        split = dict.fromkeys(CATEGORIES, 0)
        sizes: list[tuple[int, str, str]] = []
        for key, (storage, made_by) in self._storages.items():
            if key in self._parameter_keys:
                category = "parameters"
            elif key in grad_keys:
                category = "gradients"
            elif key in state_keys:
                category = "optimizer_state"
            else:
                category = "activations"
            split[category] += storage.nbytes()
            sizes.append((storage.nbytes(), category, made_by))
        assert sum(split.values()) == total, (split, total)
        return Peak(total, split, op, tuple(sorted(sizes, reverse=True)[:10]))

    def __enter__(self) -> TensorAccounting:
        self._storages.clear()
        self._parameter_keys = _keys([*self._model.parameters(), *self._model.buffers()])
        self._track(self._roots(), "<step start>")
        self.start = self._alive()
        self.peak = self._classify(self.start, "<step start>")
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)  # type: ignore[no-untyped-call]
        self.end = self._alive()
        self._storages.clear()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(getattr(func, "overloadpacket", func))
        self._track(tree_flatten((args, kwargs, out))[0], name)
        total = self._alive()
        if total > self.peak.total:
            self.peak = self._classify(total, name)
        return out


def _snapshot_module(device: torch.device) -> Any | None:
    """The device's ``memory`` module when it records allocator history, else None."""
    if device.type == "cpu":
        return None
    memory = getattr(torch.get_device_module(device.type), "memory", None)
    if callable(getattr(memory, "_record_memory_history", None)) and callable(
        getattr(memory, "_dump_snapshot", None)
    ):
        return memory
    return None


def _rss_figures(device: torch.device) -> dict[str, int]:
    peak = peak_memory_bytes(torch.device("cpu")) if device.type == "cpu" else None
    return {} if peak is None else {"rss_peak_bytes": peak}


class MemorySnapshot:
    """Measures the steps ``steps`` (1-based) of one rank (see the module docstring for the
    two methods and what each counts).

    Call ``step_begin(n)`` before step ``n`` and ``step_end(n)`` after it for every step (the
    unmeasured ones cost a set lookup), then :meth:`close`.

    Raises (constructor):
        ValueError: ``rank`` negative, or ``steps`` empty or holding a step that is not a
            positive int.
    """

    #: Allocator events kept per snapshot (older ones are dropped first).
    MAX_ENTRIES = 100_000

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        steps: Sequence[int],
        device: torch.device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if not steps or bad:
            raise ValueError(f"steps to measure must be 1-based step numbers, got {list(steps)!r}")
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.steps = frozenset(steps)
        self.device = torch.device(device)
        self.model = model
        self.optimizer = optimizer
        self._allocator = _snapshot_module(self.device)
        self._accounting: TensorAccounting | None = None
        self._step: int | None = None
        self._start_allocated = 0
        self._closed = False

    @property
    def method(self) -> str:
        """``"allocator snapshot"`` or ``"live tensors"``: how this device is measured."""
        return "live tensors" if self._allocator is None else "allocator snapshot"

    def step_begin(self, step: int) -> None:
        """Start measuring when ``step`` is one of :attr:`steps`; else do nothing.

        Raises:
            RuntimeError: a measured step is still open, or this was closed.
        """
        if self._step is not None:
            raise RuntimeError(
                f"step_begin({step}) while step {self._step} is measured; call "
                f"step_end({self._step}) first"
            )
        if self._closed:
            raise RuntimeError(f"step_begin({step}) after the memory snapshot was closed")
        if step not in self.steps:
            return
        self._step = step
        if self._allocator is None:
            self._accounting = TensorAccounting(self.model, self.optimizer)
            self._accounting.__enter__()
            return
        torch.accelerator.synchronize(self.device)
        torch.accelerator.reset_peak_memory_stats(self.device)
        self._start_allocated = torch.accelerator.memory_allocated(self.device)
        self._allocator._record_memory_history(max_entries=self.MAX_ENTRIES)

    def step_end(self, step: int) -> dict[str, int] | None:
        """Stop measuring ``step``, write its record and return its figures; None when
        ``step`` was not measured.

        Postconditions for a measured step: :func:`snapshot_path` of it (``.json`` for live
        tensors, ``.pickle`` for an allocator snapshot) is written, and the figures are bytes
        under the keys of the module docstring: ``live_tensors_peak_bytes`` split into
        ``live_parameters_bytes``, ``live_gradients_bytes``, ``live_optimizer_state_bytes``
        and ``live_activations_bytes`` (which sum to it), ``live_tensors_start_bytes``,
        ``live_tensors_end_bytes`` and ``rss_peak_bytes``; or on an accelerator
        ``device_allocated_peak_bytes``, ``device_allocated_start_bytes``,
        ``device_allocated_end_bytes`` and ``device_reserved_peak_bytes``.

        Raises:
            RuntimeError: ``step`` is not the step being measured while one is, or it is one
                to measure and its ``step_begin`` was not called.
        """
        if self._step is None:
            if step in self.steps and not self._closed:
                raise RuntimeError(f"step_end({step}) without step_begin({step})")
            return None
        if step != self._step:
            raise RuntimeError(f"step_end({step}) while step {self._step} is measured")
        self._step = None
        if self._allocator is None:
            return self._end_accounting(step)
        return self._end_allocator(step)

    def _end_accounting(self, step: int) -> dict[str, int]:
        accounting, self._accounting = self._accounting, None
        assert accounting is not None
        accounting.__exit__(None, None, None)
        peak = accounting.peak
        figures = {
            "live_tensors_peak_bytes": peak.total,
            **{CATEGORIES[c]: peak.split[c] for c in CATEGORIES},
            "live_tensors_start_bytes": accounting.start,
            "live_tensors_end_bytes": accounting.end,
            **_rss_figures(self.device),
        }
        record = {
            "rank": self.rank,
            "step": step,
            "method": self.method,
            "figures": figures,
            "peak_after_op": peak.op,
            "largest_storages_at_peak": [
                {"bytes": n, "category": c, "first_seen_after": op} for n, c, op in peak.largest
            ],
        }
        path = snapshot_path(self.out_dir, self.rank, step, ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        return figures

    def _end_allocator(self, step: int) -> dict[str, int]:
        assert self._allocator is not None
        torch.accelerator.synchronize(self.device)
        path = snapshot_path(self.out_dir, self.rank, step, ".pickle")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._allocator._dump_snapshot(os.fspath(path))
        finally:
            self._allocator._record_memory_history(enabled=None)
        return {
            "device_allocated_peak_bytes": torch.accelerator.max_memory_allocated(self.device),
            "device_allocated_start_bytes": self._start_allocated,
            "device_allocated_end_bytes": torch.accelerator.memory_allocated(self.device),
            "device_reserved_peak_bytes": torch.accelerator.max_memory_reserved(self.device),
        }

    def close(self) -> None:
        """Stop a measurement left open (a step that raised: nothing is written) and measure
        no further step; calling it again does nothing."""
        if self._step is not None:
            self._step = None
            if self._accounting is not None:
                self._accounting.__exit__(None, None, None)
                self._accounting = None
            elif self._allocator is not None:
                self._allocator._record_memory_history(enabled=None)
        self._closed = True
