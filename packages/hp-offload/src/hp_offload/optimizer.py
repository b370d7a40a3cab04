"""Optimizer-state offload: any ``torch.optim.Optimizer`` with its state in host memory.

:class:`OffloadedOptimizer` wraps an optimizer. Between steps, every state tensor with at
least one dimension (``exp_avg``, ``momentum_buffer``, ...) lives in host memory (pinned when
the compute device is an accelerator); 0-dim tensors such as AdamW's ``step`` stay where the
optimizer put them (they are bytes, and some optimizers require them on a given device).
Optionally the wrapper also keeps fp32 master copies of low-precision parameters on the host.

How a step runs (generic over optimizers, no knowledge of their update rule):

1. The parameters that have a gradient are split, in ``param_groups`` order, into buckets of
   about ``bucket_bytes`` host bytes each (:func:`hp_offload.buckets.plan_buckets`). The
   parameters of an optimizer that steps jointly (see below) are one indivisible item of the
   split, whatever its size: they go to the device together and are stepped in one call.
2. Pipeline, on a side stream (:class:`hp_offload.streams.Transfers`): prefetch bucket n+1
   to the device, update bucket n, write bucket n back to the host while n+1 updates, and
   release bucket n-1's device buffers. Event log per step: ``("prefetch", n)``,
   ``("update", n)``, ``("writeback", n)``, ``("release", n)``.
3. Updating a bucket swaps the device copies into ``optimizer.state[p]`` (and, for masters or
   streamed parameters, swaps ``p.data``/``p.grad``), narrows every ``param_group["params"]``
   to the bucket's parameters, calls the wrapped ``optimizer.step()`` once, restores the
   groups, and puts the host tensors back into the state (new state tensors created at the
   first step get new host buffers). Every hyperparameter stays the group's own; the update of
   each parameter is exactly the one the wrapped optimizer computes, so results are bit-equal
   to an unwrapped step for optimizers whose update of a parameter depends only on that
   parameter's gradient and state (AdamW, SGD, Adam, torch.optim.Muon, ...).

Joint steps. An optimizer whose update couples its parameters declares it with a true class
(or instance) attribute :data:`JOINT_STEP_ATTRIBUTE` (``steps_jointly``): hp-muon's distributed
``Muon`` does, since one step orthogonalizes every matrix in one exchange that every rank of
its process group enters with the same parameters. Its parameters with a gradient then form one
bucket, in which its groups are passed whole (parameters without a gradient included, so its
own indexing is unchanged), and it is stepped exactly once per :meth:`OffloadedOptimizer.step`
(when any of its parameters has a gradient), on every rank alike whatever ``bucket_bytes`` and
the local shard sizes are. A chain of optimizers (an optimizer with an ``optimizers`` attribute
listing members whose groups are its own and whose state its ``state`` merges, such as
``hp_muon.ChainedOptimizer``) is looked into: its joint members step whole, the others bucket
by bucket. The chain must not step a member whose groups are all empty
(``hp_muon.ChainedOptimizer`` does not), since in the other buckets the joint member's groups
are narrowed to nothing. The joint bucket's state is on the device all at once during its
update (:attr:`OffloadStepStats.largest_bucket_bytes`); between steps it is on the host like
the rest.

Consequences worth knowing: optimizer step hooks run once per bucket; optimizers whose update
couples parameters (a global norm computed inside ``step``) and that do not declare it see one
bucket at a time and are not supported; ``step(closure)`` is refused (the closure would run
once per bucket); LBFGS is refused. ``step`` returns with the host state complete (it
synchronizes on the last write-back); when the wrapped step raises, the state it had not
changed is back on the host and pending copies are finished before the error propagates.
A plain state tensor's Python attributes (a sharder's layout annotation) carry over to its
host and device copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hp_offload.buckets import plan_buckets
from hp_offload.streams import CopyEvent, Transfers

__all__ = ["JOINT_STEP_ATTRIBUTE", "MASTER_PARAMS_KEY", "OffloadStepStats", "OffloadedOptimizer"]

#: Extra top-level key of :meth:`OffloadedOptimizer.state_dict` holding the fp32 masters.
MASTER_PARAMS_KEY = "offload_master_params"

#: The attribute by which an optimizer declares that its step couples its parameters and must
#: see all of them in one call (see the module docstring).
JOINT_STEP_ATTRIBUTE = "steps_jointly"

_DEFAULT_BUCKET_BYTES = 64 * 2**20


def _offloadable(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _carry_attributes(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst`` with ``src``'s Python attributes (a plain tensor's layout annotation: optimizer
    state is laid out like its parameter, and a copy must not lose what says so)."""
    if type(src) is torch.Tensor and type(dst) is torch.Tensor and src.__dict__:
        dst.__dict__.update(src.__dict__)
    return dst


@dataclass(frozen=True)
class OffloadStepStats:
    """What one :meth:`OffloadedOptimizer.step` moved.

    Attributes:
        buckets: buckets of the step (a joint optimizer's parameters count as one bucket).
        h2d_copies: host-to-device copies.
        h2d_bytes: bytes copied host to device.
        d2h_copies: device-to-host copies.
        d2h_bytes: bytes copied device to host.
        largest_bucket_bytes: the most bytes one bucket brought to the device: about the
            device memory the step's state needs at once, two buckets overlapping in the
            pipeline aside (a joint optimizer's whole state where it has one).
        joint_steps: calls of the wrapped step that stepped a joint optimizer whole (one per
            joint optimizer with a gradient).
    """

    buckets: int
    h2d_copies: int
    h2d_bytes: int
    d2h_copies: int
    d2h_bytes: int
    largest_bucket_bytes: int = 0
    joint_steps: int = 0


@dataclass
class _Planned:
    """A bucket's parameters and the joint optimizers (indices into the step's
    :meth:`OffloadedOptimizer._joint_parts`) stepped whole with it."""

    params: list[nn.Parameter]
    joint: list[int] = field(default_factory=list)


@dataclass
class _Bucket:
    index: int
    params: list[nn.Parameter]
    ready: CopyEvent
    nbytes: int = 0  # bytes brought to the device
    whole: set[int] = field(default_factory=set)  # ids of the groups stepped whole
    joint: int = 0  # joint optimizers stepped whole in this bucket
    state: dict[nn.Parameter, dict[str, torch.Tensor]] = field(default_factory=dict)
    data: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    grad: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    keep: list[torch.Tensor] = field(default_factory=list)
    written: CopyEvent | None = None


class OffloadedOptimizer:
    """Run ``optimizer`` with its state (and optional fp32 masters) kept in host memory.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (not LBFGS) over the parameters to train.
        bucket_bytes: host bytes streamed per bucket (state, masters, streamed parameters and
            gradients; before the state exists, a parameter's own bytes stand in).
        master_params: keep an fp32 master of every parameter on the host; the optimizer
            updates the master (with the gradient cast to fp32) and the parameter receives the
            master cast to its dtype. For bf16/fp16 models.
        device: the compute device the update runs on (default: where the parameters are).
        stream_parameters: also stream each parameter and its gradient host->device->host
            with its bucket. Default: on exactly when the parameters live on the host and
            ``device`` is another device (for example after
            :func:`hp_offload.offload_parameters`); ``True`` on the CPU exercises the path.

    Postconditions (after construction and after every :meth:`step`): every state tensor
    with a dimension is a host tensor (pinned on accelerators); masters equal the last update.

    Raises:
        TypeError: ``optimizer`` is not an Optimizer, or is LBFGS; a chain's ``optimizers``
            holds a non-optimizer; a ``steps_jointly`` that is not a bool.
        ValueError: a joint member of a chain whose groups are not the chain's, parameters on
            several devices, parameters neither on ``device`` nor on the
            host, ``stream_parameters`` contradicting where parameters are, non-floating
            parameters with ``master_params``, a non-positive ``bucket_bytes``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
        master_params: bool = False,
        device: torch.device | str | None = None,
        stream_parameters: bool | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS is not supported: its step re-evaluates a closure and keeps state over "
                "all parameters at once, which a per-bucket step cannot reproduce"
            )
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.optimizer = optimizer
        self.bucket_bytes = bucket_bytes
        self.master_params = master_params
        params = self._params()
        if not params:
            raise ValueError("the optimizer has no parameters")
        self._joint_parts()  # a malformed chain is refused here rather than at the first step
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, found {sorted(map(str, devices))}; "
                "wrap one optimizer per device"
            )
        param_device = devices.pop()
        self.transfers = Transfers(param_device if device is None else device)
        on_host = param_device == self.transfers.host
        on_device = param_device == self.transfers.device
        if not (on_host or on_device):
            raise ValueError(
                f"parameters are on {param_device}, neither the compute device "
                f"{self.transfers.device} nor the host {self.transfers.host}"
            )
        if stream_parameters is None:
            stream_parameters = not on_device
        elif stream_parameters and not on_host:
            raise ValueError(
                f"stream_parameters=True needs the parameters on the host "
                f"({self.transfers.host}), they are on {param_device}"
            )
        elif not stream_parameters and not on_device:
            raise ValueError(
                f"parameters are on the host ({param_device}) but the compute device is "
                f"{self.transfers.device}: pass stream_parameters=True (or leave it None)"
            )
        self.stream_parameters = stream_parameters
        if master_params:
            bad = [tuple(p.shape) for p in params if not p.is_floating_point()]
            if bad:
                raise ValueError(f"master_params needs floating parameters, got shapes {bad}")
        self._masters: dict[nn.Parameter, torch.Tensor] = {}
        #: ``(event, bucket)`` entries of the last :meth:`step`, in issue order.
        self.event_log: list[tuple[str, int]] = []
        self.last_step_stats: OffloadStepStats | None = None
        self._ensure_masters()
        self._state_to_host()

    # -- public optimizer surface ---------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (hyperparameters may be edited)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        """The wrapped optimizer's state (host tensors between steps)."""
        return self.optimizer.state

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 host master of ``param``. Raises KeyError without ``master_params``."""
        if not self.master_params:
            raise KeyError("master_params=False: there are no master parameters")
        return self._masters[param]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One optimizer step over every parameter with a gradient, bucket by bucket.

        Postconditions: parameters hold the wrapped optimizer's update; the host state and
        masters are complete (synchronized); :attr:`event_log` and :attr:`last_step_stats`
        describe this step.

        Raises:
            TypeError: a closure was given.
            ValueError: a sparse gradient, or a state tensor found off the host.
        """
        if closure is not None:
            raise TypeError(
                "OffloadedOptimizer.step does not take a closure: the wrapped step runs once "
                "per bucket, so the closure would be evaluated once per bucket"
            )
        self._ensure_masters()
        live = [p for p in self._params() if p.grad is not None]
        for p in live:
            assert p.grad is not None
            if p.grad.is_sparse:
                raise ValueError(f"sparse gradients are not supported (parameter {tuple(p.shape)})")
        joint = self._joint_parts()
        buckets = self._plan(live, joint)
        stats = self.transfers.stats
        stats.reset()
        self.event_log = []
        largest, joint_steps = self._pipeline(buckets, joint)
        self.last_step_stats = OffloadStepStats(
            buckets=len(buckets),
            h2d_copies=stats.h2d_copies,
            h2d_bytes=stats.h2d_bytes,
            d2h_copies=stats.d2h_copies,
            d2h_bytes=stats.d2h_bytes,
            largest_bucket_bytes=largest,
            joint_steps=joint_steps,
        )

    def _pipeline(
        self, buckets: list[_Planned], joint: list[list[dict[str, Any]]]
    ) -> tuple[int, int]:
        """Prefetch n+1, update n, release n-1; returns the most bytes one bucket brought to the
        device and the joint steps taken. On an error, the copies in flight finish before it
        propagates (their device buffers must outlive them)."""
        largest = joint_steps = 0
        previous: _Bucket | None = None
        upcoming = self._prefetch(0, buckets[0], joint) if buckets else None
        try:
            for n in range(len(buckets)):
                current = upcoming
                assert current is not None
                upcoming = (
                    self._prefetch(n + 1, buckets[n + 1], joint) if n + 1 < len(buckets) else None
                )
                self._update(current)
                largest = max(largest, current.nbytes)
                joint_steps += current.joint
                if previous is not None:
                    self._release(previous)
                previous = current
        except BaseException:
            if previous is not None and previous.written is not None:
                previous.written.synchronize()
            if upcoming is not None:
                upcoming.ready.synchronize()
            raise
        if previous is not None:
            self._release(previous)
            assert previous.written is not None
            previous.written.synchronize()
        return largest, joint_steps

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (same format, host tensors), plus, with
        ``master_params``, :data:`MASTER_PARAMS_KEY`: ``{param index: fp32 master}`` with the
        indices of the ``"state"`` entry."""
        sd = self.optimizer.state_dict()
        if self.master_params:
            self._ensure_masters()
            sd[MASTER_PARAMS_KEY] = {i: self._masters[p] for i, p in enumerate(self._params())}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (or a plain state dict of the wrapped optimizer).

        The wrapped optimizer's own ``load_state_dict`` runs with every parameter's data
        temporarily replaced by an empty host stand-in (fp32 with masters), so loaded state
        goes straight to host memory with the dtype the updates use, never to the device.

        Postconditions: state tensors are host tensors; with masters, masters and parameters
        hold the loaded masters (parameters cast to their dtype).

        Raises:
            ValueError: masters present without ``master_params``, or missing with it, or not
                matching the parameters' shapes.
        """
        state_dict = dict(state_dict)
        masters = state_dict.pop(MASTER_PARAMS_KEY, None)
        if masters is None and self.master_params:
            raise ValueError(f"master_params=True but the state dict has no {MASTER_PARAMS_KEY!r}")
        if masters is not None and not self.master_params:
            raise ValueError(f"state dict has {MASTER_PARAMS_KEY!r} but master_params=False")
        params = self._params()
        with self._stand_ins(params):
            self.optimizer.load_state_dict(state_dict)
        self._state_to_host()
        if masters is not None:
            self._ensure_masters()
            if sorted(masters) != list(range(len(params))):
                raise ValueError(
                    f"{MASTER_PARAMS_KEY!r} has indices {sorted(masters)}, expected "
                    f"0..{len(params) - 1}"
                )
            with torch.no_grad():
                for i, p in enumerate(params):
                    src = masters[i]
                    if src.shape != p.shape:
                        raise ValueError(
                            f"master {i} has shape {tuple(src.shape)}, parameter {tuple(p.shape)}"
                        )
                    self._masters[p].copy_(src)
                    p.copy_(src)

    # -- internals ------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _joint_parts(self) -> list[list[dict[str, Any]]]:
        """The param groups of each optimizer that steps jointly: the wrapped one, or the
        members of a chain (an ``optimizers`` attribute), in order.

        Raises:
            TypeError: a chain's ``optimizers`` holds something other than optimizers, or a
                :data:`JOINT_STEP_ATTRIBUTE` is not a bool.
            ValueError: a joint member's groups are not the chain's own group dicts, or a
                member's state is missing from the chain's.
        """
        chained = getattr(self.optimizer, "optimizers", None)
        parts = [self.optimizer] if chained is None else list(chained)
        wrong = [type(o).__name__ for o in parts if not isinstance(o, torch.optim.Optimizer)]
        if wrong:
            raise TypeError(
                f"{type(self.optimizer).__name__}.optimizers is taken as a chain of optimizers "
                f"and must hold torch.optim.Optimizer instances, found {wrong}"
            )
        own = {id(g) for g in self.optimizer.param_groups}
        for part in parts if chained is not None else ():
            if any(p not in self.optimizer.state for p in part.state):
                raise ValueError(
                    f"{type(self.optimizer).__name__}.state lacks the state of its member "
                    f"{type(part).__name__}: a chain's state must be its members' state merged "
                    "(as hp_muon.ChainedOptimizer's is), or the wrapper cannot offload it"
                )
        joint: list[list[dict[str, Any]]] = []
        for part in parts:
            flag = getattr(part, JOINT_STEP_ATTRIBUTE, False)
            if not isinstance(flag, bool):
                raise TypeError(
                    f"{type(part).__name__}.{JOINT_STEP_ATTRIBUTE} must be a bool, got {flag!r}"
                )
            if not flag:
                continue
            if any(id(g) not in own for g in part.param_groups):
                raise ValueError(
                    f"{type(part).__name__} steps jointly but its param groups are not "
                    f"{type(self.optimizer).__name__}'s own group dicts: the wrapper hands it "
                    "its whole groups by setting the chain's, so a chain must list its members' "
                    "very group dicts (as hp_muon.ChainedOptimizer does)"
                )
            joint.append(list(part.param_groups))
        return joint

    def _plan(self, live: list[nn.Parameter], joint: list[list[dict[str, Any]]]) -> list[_Planned]:
        """``live`` in buckets of about :attr:`bucket_bytes`; each joint optimizer's parameters
        are one item, placed where its first one is."""
        part_of = {id(p): k for k, groups in enumerate(joint) for g in groups for p in g["params"]}
        items: list[tuple[_Planned, int]] = []
        first: dict[int, int] = {}
        for p in live:
            nbytes = self._bucket_nbytes(p)
            k = part_of.get(id(p))
            if k is None:
                items.append((_Planned([p]), nbytes))
                continue
            if k not in first:
                first[k] = len(items)
                items.append((_Planned([], [k]), 0))
            planned, size = items[first[k]]
            planned.params.append(p)
            items[first[k]] = (planned, size + nbytes)
        return [
            _Planned(
                [p for item in bucket for p in item.params], [k for i in bucket for k in i.joint]
            )
            for bucket in plan_buckets(items, self.bucket_bytes)
        ]

    def _ensure_masters(self) -> None:
        if not self.master_params:
            return
        for p in self._params():
            if p not in self._masters:
                self._masters[p] = self.transfers.to_host_copy(p.detach(), torch.float32)

    def _state_to_host(self) -> None:
        t = self.transfers
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if _offloadable(value) and (
                    value.device != t.host or (t.pin and not value.is_pinned())
                ):
                    state[key] = _carry_attributes(value, t.to_host_copy(value))

    @contextmanager
    def _stand_ins(self, params: list[nn.Parameter]) -> Iterator[None]:
        saved: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
        try:
            for p in params:
                dtype = torch.float32 if self.master_params else p.dtype
                saved.append((p, p.data, p.grad))
                p.grad = None
                p.data = torch.empty((0,), dtype=dtype, device=self.transfers.host)
            yield
        finally:
            for p, data, grad in saved:
                p.grad = None
                p.data = data
                p.grad = grad

    def _bucket_nbytes(self, p: nn.Parameter) -> int:
        state = self.optimizer.state.get(p, {})
        nbytes = sum(_nbytes(v) for v in state.values() if _offloadable(v))
        if not state:
            nbytes += _nbytes(p)
        if self.master_params:
            nbytes += 4 * p.numel()
        if self.stream_parameters:
            assert p.grad is not None
            nbytes += _nbytes(p) + _nbytes(p.grad)
        return nbytes

    def _prefetch(
        self, index: int, planned: _Planned, joint: list[list[dict[str, Any]]]
    ) -> _Bucket:
        t = self.transfers
        params = planned.params
        sources: list[torch.Tensor] = []
        slots: list[tuple[str, nn.Parameter, str]] = []
        for p in params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if not _offloadable(value):
                    continue
                if value.device != t.host:
                    raise ValueError(
                        f"state {key!r} of parameter {tuple(p.shape)} is on {value.device}, "
                        f"expected the host {t.host}: was the state replaced outside the wrapper?"
                    )
                sources.append(value)
                slots.append(("state", p, key))
            if self.master_params:
                sources.append(self._masters[p])
                slots.append(("data", p, ""))
            elif self.stream_parameters:
                sources.append(p.data)
                slots.append(("data", p, ""))
            if self.stream_parameters:
                assert p.grad is not None
                sources.append(p.grad)
                slots.append(("grad", p, ""))
        copies, ready = t.h2d(sources)
        whole = {id(g) for k in planned.joint for g in joint[k]}
        nbytes = sum(_nbytes(src) for src in sources)
        bucket = _Bucket(index, params, ready, nbytes, whole, len(planned.joint))
        for (kind, p, key), src, dev in zip(slots, sources, copies, strict=True):
            if kind == "state":
                bucket.state.setdefault(p, {})[key] = _carry_attributes(src, dev)
            elif kind == "data":
                bucket.data[p] = dev
            else:
                bucket.grad[p] = dev
        self.event_log.append(("prefetch", index))
        return bucket

    def _update(self, bucket: _Bucket) -> None:
        t = self.transfers
        bucket.ready.wait_on_compute(t)
        members = set(bucket.params)
        host_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        swapped: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []
        groups = self.optimizer.param_groups
        full = [g["params"] for g in groups]
        try:
            for p in bucket.params:
                if p in bucket.state:
                    state = self.optimizer.state[p]
                    host_state[p] = {k: state[k] for k in bucket.state[p]}
                    state.update(bucket.state[p])
                if p in bucket.data or p in bucket.grad:
                    grad = bucket.grad.get(p, p.grad)
                    assert grad is not None
                    if self.master_params:
                        grad = grad.float()
                    swapped.append((p, p.data, p.grad))
                    p.grad = None
                    p.data = bucket.data.get(p, p.data)
                    p.grad = grad
            for g, ps in zip(groups, full, strict=True):
                # A joint optimizer's groups go whole: its step indexes every parameter.
                g["params"] = ps if id(g) in bucket.whole else [p for p in ps if p in members]
            self.event_log.append(("update", bucket.index))
            self.optimizer.step()
        except BaseException:
            # The state as it was before the bucket, on the host (the failed step's device
            # copies are dropped).
            for p, old in host_state.items():
                self.optimizer.state[p].update(old)
            raise
        finally:
            for g, ps in zip(groups, full, strict=True):
                g["params"] = ps
            for p, data, grad in swapped:
                p.grad = None
                p.data = data
                p.grad = grad
        self._write_back(bucket, host_state)

    def _write_back(
        self, bucket: _Bucket, host_state: dict[nn.Parameter, dict[str, torch.Tensor]]
    ) -> None:
        t = self.transfers
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in bucket.params:
            state = self.optimizer.state.get(p, {})
            old = host_state.get(p, {})
            for key, dev in list(state.items()):
                if not _offloadable(dev):
                    continue
                host = old.get(key)
                if host is None or host.shape != dev.shape or host.dtype != dev.dtype:
                    host = _carry_attributes(dev, t.host_empty_like(dev))
                pairs.append((dev, host))
                state[key] = host
            if p in bucket.data:
                result = bucket.data[p]
                if self.master_params:
                    pairs.append((result, self._masters[p]))
                    if self.stream_parameters:
                        cast = result.to(p.dtype)
                        pairs.append((cast, p.data))
                        bucket.keep.append(cast)
                    else:
                        p.data.copy_(result)
                else:
                    pairs.append((result, p.data))
        bucket.keep.extend(dev for dev, _ in pairs)
        bucket.written = t.d2h(pairs)
        self.event_log.append(("writeback", bucket.index))

    def _release(self, bucket: _Bucket) -> None:
        assert bucket.written is not None
        bucket.written.wait_on_compute(self.transfers)
        bucket.keep.clear()
        bucket.state.clear()
        bucket.data.clear()
        bucket.grad.clear()
        self.event_log.append(("release", bucket.index))
