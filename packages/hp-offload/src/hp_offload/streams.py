"""A compute device, a host, and a side stream for the copies between them.

:class:`Transfers` is the one place offload code moves bytes between host and device. On an
accelerator (``cuda``, ``npu``, ... through ``torch.accelerator`` and the generic
``torch.Stream`` / ``torch.Event``; no device module is named) copies run on a side stream and
the compute stream waits on events. On the CPU the "device" is the CPU too: copies run
synchronously into separate tensors, so every movement still happens (and is counted) and
the offload logic runs in CI unchanged.

Stream discipline (accelerators): a device buffer is allocated on the compute stream; the side
stream waits for the compute stream before copying into or out of it, and the compute stream
waits for the copy's event before using the buffer or before the last reference to it is
dropped. That keeps the caching allocator from reusing memory a copy still reads or writes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["CopyEvent", "TransferStats", "Transfers", "default_device"]


def default_device() -> torch.device:
    """The current accelerator (``torch.accelerator``), or the CPU when there is none."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device("cpu") if acc is None else acc


@dataclass
class TransferStats:
    """Counters of host<->device copies (mutable; reset with :meth:`reset`)."""

    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        """Postcondition: every counter is 0."""
        self.h2d_copies = self.h2d_bytes = self.d2h_copies = self.d2h_bytes = 0


class CopyEvent:
    """Completion of a group of copies issued on the side stream (trivially done on the CPU)."""

    def __init__(self, event: torch.Event | None) -> None:
        self._event = event

    def wait_on_compute(self, transfers: Transfers) -> None:
        """Make the compute stream wait for the copies (no host block)."""
        if self._event is not None:
            transfers.compute_stream().wait_event(self._event)

    def synchronize(self) -> None:
        """Block the host until the copies are done. Postcondition: host buffers are valid."""
        if self._event is not None:
            self._event.synchronize()


class Transfers:
    """Copies between ``host`` memory and the compute ``device``.

    Args:
        device: the compute device (default: :func:`default_device`).
        host: where offloaded tensors live (default: the CPU). Host buffers are pinned when
            ``device`` is an accelerator and ``host`` is the CPU.

    Raises:
        ValueError: ``device`` is an accelerator other than the current one, or ``host`` is
            an accelerator while ``device`` is the CPU.
    """

    def __init__(self, device: torch.device | str | None = None, host: torch.device | str = "cpu"):
        self.device = default_device() if device is None else torch.device(device)
        self.host = torch.device(host)
        self.accelerated = self.device.type != "cpu"
        if self.accelerated:
            acc = default_device()
            if acc.type != self.device.type:
                raise ValueError(
                    f"device {self.device} is not the current accelerator ({acc}); offload "
                    "streams go through torch.accelerator, so pass that device or the CPU"
                )
            if str(self.device) == self.device.type:  # no index: the current one
                index = torch.accelerator.current_device_index()
                self.device = torch.device(self.device.type, index)
        elif self.host.type != "cpu":
            raise ValueError(f"host {self.host} must be the CPU when the device is the CPU")
        self.pin = self.accelerated and self.host.type == "cpu"
        self._side: torch.Stream | None = (
            torch.Stream(device=self.device) if self.accelerated else None
        )
        self.stats = TransferStats()

    # -- streams ---------------------------------------------------------------------------
    def compute_stream(self) -> torch.Stream:
        """The current stream of ``device`` (accelerators only)."""
        return torch.accelerator.current_stream(self.device)

    def _record(self, stream: torch.Stream) -> torch.Event:
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    @contextmanager
    def _on_side(self) -> Iterator[None]:
        """Run the body on the side stream, after all work queued so far on compute."""
        if self._side is None:
            yield
            return
        compute = self.compute_stream()
        self._side.wait_event(self._record(compute))
        torch.accelerator.set_stream(self._side)
        try:
            yield
        finally:
            torch.accelerator.set_stream(compute)

    def _done(self) -> CopyEvent:
        return CopyEvent(None if self._side is None else self._record(self._side))

    # -- buffers ---------------------------------------------------------------------------
    def host_empty_like(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new host tensor of ``t``'s shape (pinned when :attr:`pin`), contiguous."""
        dtype = t.dtype if dtype is None else dtype
        if type(t) is not torch.Tensor:  # a subclass (DTensor): keep its wrapper
            return torch.empty_like(t, dtype=dtype, device=self.host)
        return torch.empty(t.shape, dtype=dtype, device=self.host, pin_memory=self.pin)

    def to_host_copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A synchronous host copy of ``t`` (setup paths only; counted as device-to-host)."""
        out = self.host_empty_like(t, dtype)
        out.copy_(t)
        self.stats.d2h_copies += 1
        self.stats.d2h_bytes += out.numel() * out.element_size()
        return out

    def h2d(self, sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], CopyEvent]:
        """Start copying host tensors to new device tensors.

        Postcondition: the returned device tensors hold ``sources`` once the event is done
        (use :meth:`CopyEvent.wait_on_compute` before reading them on the compute stream).
        """
        outs = [torch.empty_like(s, device=self.device) for s in sources]
        with self._on_side():
            for dst, src in zip(outs, sources, strict=True):
                dst.copy_(src, non_blocking=self.accelerated)
                self.stats.h2d_copies += 1
                self.stats.h2d_bytes += src.numel() * src.element_size()
        return outs, self._done()

    def d2h(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyEvent:
        """Start copying ``(device_src, host_dst)`` pairs, after all compute queued so far.

        Postcondition: each host tensor holds its source once the event is done; keep the
        device sources referenced until the compute stream has waited on the event.
        """
        with self._on_side():
            for src, dst in pairs:
                dst.copy_(src, non_blocking=self.accelerated)
                self.stats.d2h_copies += 1
                self.stats.d2h_bytes += src.numel() * src.element_size()
        return self._done()
