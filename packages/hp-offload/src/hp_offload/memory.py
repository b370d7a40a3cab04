"""Saved-tensor byte accounting: how many bytes a forward leaves behind for its backward.

:class:`ActivationMeter` is a context manager. While it is active:

* every tensor autograd saves *outside* a wrapper of this package passes through the meter's
  saved-tensor hooks and is counted on the device while its saved slot lives (this includes
  the layer inputs that ``torch.utils.checkpoint`` saves);
* the wrappers of this package report what they hold themselves through :func:`track`:
  op outputs a selective checkpoint caches (device), tensors swapped to host memory (host),
  and device tensors whose offload copy is still in flight (device).

Bytes are counted per storage (a view holds its whole storage; two views of one storage count
once), reference-counted, and the peak is kept. Storages of excluded tensors (give the model's
parameters and buffers) are never counted. Not counted: the transient tensors of the one layer
being recomputed during its own backward (held by the checkpoint machinery for the duration of
that layer's backward only), and temporaries inside ops. On an accelerator, read the allocator
peak (``torch.accelerator.max_memory_allocated``) as well.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Literal

import torch

__all__ = ["ActivationMeter", "Place", "Token", "active_meter", "track"]

Place = Literal["device", "host"]
_ACTIVE: list[ActivationMeter] = []


def _storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.nbytes())


class Token:
    """A counted hold on one storage; the count drops when the token is released or collected."""

    __slots__ = ("__weakref__", "_key", "_meter", "_place")

    def __init__(self, meter: ActivationMeter, key: tuple[str, int, int], place: Place) -> None:
        self._meter: ActivationMeter | None = meter
        self._key = key
        self._place: Place = place

    def release(self) -> None:
        """Stop counting (idempotent)."""
        meter, self._meter = self._meter, None
        if meter is not None:
            meter._release(self._key, self._place)

    def __del__(self) -> None:
        self.release()


class ActivationMeter:
    """Live and peak bytes held for backward, per place (``"device"``, ``"host"``).

    Postconditions after the ``with`` block: :attr:`peak` holds the largest device byte count
    seen, :attr:`peak_host` the largest host byte count, :attr:`live` and :attr:`live_host` the
    current counts (0 once every counted slot was consumed by backward or freed).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t)[:2] for t in exclude}
        self._refs: dict[tuple[Place, tuple[str, int, int]], int] = {}
        self._lock = threading.Lock()
        self.live = 0
        self.live_host = 0
        self.peak = 0
        self.peak_host = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def hold(self, t: torch.Tensor, place: Place) -> Token | None:
        """Count ``t``'s storage at ``place`` until the returned token goes away.

        Postcondition: None (nothing counted) for an excluded storage.
        """
        key = _storage_key(t)
        if key[:2] in self._exclude:
            return None
        with self._lock:
            ref = (place, key)
            n = self._refs.get(ref, 0)
            self._refs[ref] = n + 1
            if n == 0:
                if place == "device":
                    self.live += key[2]
                    self.peak = max(self.peak, self.live)
                else:
                    self.live_host += key[2]
                    self.peak_host = max(self.peak_host, self.live_host)
        return Token(self, key, place)

    def _release(self, key: tuple[str, int, int], place: Place) -> None:
        with self._lock:
            ref = (place, key)
            n = self._refs[ref] - 1
            if n:
                self._refs[ref] = n
                return
            del self._refs[ref]
            if place == "device":
                self.live -= key[2]
            else:
                self.live_host -= key[2]

    def reset_peak(self) -> None:
        """Set the peaks to the live counts."""
        with self._lock:
            self.peak, self.peak_host = self.live, self.live_host

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, Token | None]:
        return (t, self.hold(t, "device"))

    @staticmethod
    def _unpack(packed: tuple[torch.Tensor, Token | None]) -> torch.Tensor:
        return packed[0]

    def __enter__(self) -> ActivationMeter:
        if self._hooks is not None:
            raise RuntimeError("ActivationMeter is already active; it cannot be nested in itself")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        _ACTIVE.remove(self)
        self._hooks.__exit__(None, None, None)
        self._hooks = None


def active_meter() -> ActivationMeter | None:
    """The innermost active meter, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


def track(t: torch.Tensor, place: Place) -> Token | None:
    """Report that a wrapper holds ``t`` at ``place`` for backward; keep the token as long.

    Postcondition: None when no meter is active (no cost beyond one list lookup).
    """
    meter = active_meter()
    return meter.hold(t, place) if meter is not None else None
