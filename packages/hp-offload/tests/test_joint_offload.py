"""OffloadedOptimizer with optimizers that step jointly (``steps_jointly``), alone or chained.

The joint optimizer here couples its parameters the way a distributed Muon does in spirit:
its update divides every parameter's momentum by the norm over *all* its parameters, so a step
that saw one bucket at a time would compute another update. The oracle is the same optimizer
unwrapped; a subclass that does not declare ``steps_jointly`` shows the difference is real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from hp_offload import OffloadedOptimizer
from hp_offload.optimizer import JOINT_STEP_ATTRIBUTE


class GlobalNormMomentum(torch.optim.Optimizer):
    """``buf = m * buf + grad``; ``p -= lr * buf / ||all bufs||``: coupled through the norm."""

    steps_jointly = True

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})
        self.calls = 0
        self.seen: list[int] = []  # parameters with a gradient, per call
        self.held: list[int] = []  # parameters in the groups, per call
        self.fail = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.calls += 1
        live = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.seen.append(len(live))
        self.held.append(sum(len(g["params"]) for g in self.param_groups))
        if self.fail:
            raise RuntimeError("planted failure before any state changes")
        for g, p in live:
            state = self.state[p]
            if "buf" not in state:
                state["buf"] = torch.zeros_like(p)
            state["buf"].mul_(g["momentum"]).add_(p.grad)
        if not live:
            return
        norm = torch.sqrt(sum(self.state[p]["buf"].square().sum() for _, p in live))
        for g, p in live:
            p.sub_(self.state[p]["buf"] / norm, alpha=g["lr"])


class PerBucketMomentum(GlobalNormMomentum):
    """The same update, undeclared: the wrapper steps it bucket by bucket."""

    steps_jointly = False


class Chain(torch.optim.Optimizer):
    """A minimal chain of the contract the wrapper reads (``optimizers``, whose groups are the
    chain's own dicts and whose state ``state`` merges; members with no parameters are not
    stepped), as hp-muon's is."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self.state = _Merged(self.optimizers)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            if any(g["params"] for g in o.param_groups):
                o.step()


class _Merged(MutableMapping[torch.Tensor, Any]):
    """The members' state as one mapping, each parameter's in its owner's."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._owner = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}
        self._optimizers = optimizers

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._owner[p].state[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._owner[p].state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._owner[p].state[p]

    def __contains__(self, p: object) -> bool:
        return p in self._owner and p in self._owner[p].state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def _train(model: nn.Module, opt: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    weights = [p for p in model.parameters() if p.dim() == 2]
    return weights, [p for p in model.parameters() if p.dim() < 2]


Factory = Callable[[nn.Module], torch.optim.Optimizer]


def _joint(model: nn.Module) -> torch.optim.Optimizer:
    return GlobalNormMomentum(model.parameters())


def _chained(model: nn.Module) -> torch.optim.Optimizer:
    weights, rest = _split(model)
    # AdamW first: the joint member's bucket is not the first one.
    return Chain([torch.optim.AdamW(rest, lr=1e-2), GlobalNormMomentum(weights)])


@pytest.mark.parametrize("factory", [_joint, _chained], ids=["alone", "chained"])
def test_joint_optimizer_is_stepped_whole_and_bit_equal(factory: Factory) -> None:
    ref, off = _model(), _model()
    _train(ref, factory(ref), 3)
    opt = factory(off)
    wrapped = OffloadedOptimizer(opt, bucket_bytes=1)
    _train(off, wrapped, 3)
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b)
    alone = isinstance(opt, GlobalNormMomentum)
    joint: Any = opt if alone else opt.optimizers[1]  # type: ignore[attr-defined]
    assert joint.calls == 3  # once per step
    assert joint.seen == [8 if alone else 4] * 3  # with every parameter
    stats = wrapped.last_step_stats
    assert stats is not None
    assert stats.joint_steps == 1
    bufs = 4 * (16 * 16 + 16) * 4 if alone else 4 * 16 * 16 * 4
    assert stats.largest_bucket_bytes == bufs  # the joint state, all at once
    # chained: the 4 biases' AdamW state, one bucket each (bucket_bytes=1)
    assert stats.buckets == (1 if factory is _joint else 5)
    for state in wrapped.state.values():
        for value in state.values():
            assert value.dim() == 0 or value.device == wrapped.transfers.host


def test_joint_groups_go_whole() -> None:
    """A joint optimizer's step sees its groups whole, parameters without a gradient
    included (its own indexing of them is unchanged), and updates the others only."""
    model = _model()
    opt = GlobalNormMomentum(model.parameters())
    wrapped = OffloadedOptimizer(opt, bucket_bytes=1)
    frozen = next(iter(model.parameters()))
    kept = frozen.detach().clone()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        wrapped.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        frozen.grad = None
        wrapped.step()
    assert opt.seen == [7, 7]
    assert opt.held == [8, 8]
    assert torch.equal(frozen, kept)
    assert frozen not in opt.state


def test_undeclared_coupling_differs() -> None:
    """Without ``steps_jointly`` the coupled optimizer sees one bucket at a time: other
    parameters (what the declaration prevents)."""
    ref, off = _model(), _model()
    _train(ref, PerBucketMomentum(ref.parameters()), 2)
    opt = PerBucketMomentum(off.parameters())
    _train(off, OffloadedOptimizer(opt, bucket_bytes=1), 2)
    assert opt.seen == [1] * 16  # 8 parameters, 2 steps
    pairs = zip(ref.parameters(), off.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)


def test_failed_joint_step_leaves_host_state() -> None:
    """A joint step that raises leaves the host state as it was (the same tensors, the same
    values); stepping again with the same gradients is the unwrapped optimizer's step."""
    ref, off = _model(), _model()
    plain = GlobalNormMomentum(ref.parameters())
    _train(ref, plain, 1)
    opt = GlobalNormMomentum(off.parameters())
    wrapped = OffloadedOptimizer(opt, bucket_bytes=1)
    _train(off, wrapped, 1)
    before = {p: (s["buf"], s["buf"].clone()) for p, s in opt.state.items()}
    opt.fail = True
    with pytest.raises(RuntimeError, match="planted failure"):
        wrapped.step()
    for p, (tensor, values) in before.items():
        assert opt.state[p]["buf"] is tensor
        assert torch.equal(tensor, values)
    opt.fail = False
    wrapped.step()  # the gradients of step 1 again
    plain.step()
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_attributes_carry_over() -> None:
    """A plain state tensor's Python attributes (a sharder's layout annotation) survive the
    trips to the host and the device."""
    model = _model()
    opt = GlobalNormMomentum(model.parameters())
    _train(model, opt, 1)
    for p in model.parameters():
        opt.state[p]["buf"].layout_note = ("rows", tuple(p.shape))
    wrapped = OffloadedOptimizer(opt, bucket_bytes=1)
    seen: list[object] = []
    step = opt.step

    def looking(closure: Any = None) -> None:
        seen.extend(getattr(s["buf"], "layout_note", None) for s in opt.state.values())
        step()

    opt.step = looking  # type: ignore[method-assign]
    _train(model, wrapped, 2)
    assert len(seen) == 2 * 8
    assert all(note is not None for note in seen)
    for p in model.parameters():
        assert opt.state[p]["buf"].layout_note == ("rows", tuple(p.shape))


def test_bad_joint_declarations() -> None:
    model = _model()
    weights, rest = _split(model)

    class NotAChain(torch.optim.SGD):
        optimizers = ("adamw",)

    with pytest.raises(TypeError, match=r"must hold torch\.optim\.Optimizer instances.*'str'"):
        OffloadedOptimizer(NotAChain(model.parameters(), lr=0.1))

    class Sloppy(Chain):
        """Copies its members' groups: the wrapper could not hand the joint member its own."""

        def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
            self.optimizers = list(optimizers)
            groups = [dict(g) for o in self.optimizers for g in o.param_groups]
            torch.optim.Optimizer.__init__(self, groups, {})

    with pytest.raises(ValueError, match="GlobalNormMomentum steps jointly but its param groups"):
        OffloadedOptimizer(Sloppy([GlobalNormMomentum(weights), torch.optim.AdamW(rest)]))

    class Vague(GlobalNormMomentum):
        steps_jointly = "yes"  # type: ignore[assignment]

    with pytest.raises(TypeError, match=f"Vague.{JOINT_STEP_ATTRIBUTE} must be a bool"):
        OffloadedOptimizer(Vague(model.parameters()))

    class Forgetful(Chain):
        """Keeps a state of its own: its members' state would never reach the host."""

        def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
            self.optimizers = list(optimizers)
            groups = [g for o in self.optimizers for g in o.param_groups]
            torch.optim.Optimizer.__init__(self, groups, {})

    members = [GlobalNormMomentum(weights), torch.optim.AdamW(rest)]
    _train(model, Chain(members), 1)
    with pytest.raises(ValueError, match=r"Forgetful\.state lacks the state of its member"):
        OffloadedOptimizer(Forgetful(members))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_joint_state_pinned_on_host_and_on_device_for_the_step() -> None:
    ref, off = _model().cuda(), _model().cuda()
    _train(ref, _chained(ref), 3)
    opt = _chained(off)
    joint = opt.optimizers[1]  # type: ignore[attr-defined]
    where: list[set[str]] = []
    step = joint.step

    def looking(closure: Any = None) -> None:
        where.append({s["buf"].device.type for s in joint.state.values()})
        step()

    joint.step = looking
    wrapped = OffloadedOptimizer(opt, bucket_bytes=1)
    _train(off, wrapped, 3)
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b)
    assert where[1:] == [{"cuda"}, {"cuda"}]  # the step sees device copies
    for state in opt.state.values():
        for value in state.values():
            assert value.dim() == 0 or (value.device.type == "cpu" and value.is_pinned())
