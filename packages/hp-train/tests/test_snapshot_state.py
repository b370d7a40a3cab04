"""A rank's state as snapshot bytes and back (``hp_train.recovery.state``), in one process:
the restore into a fresh model and optimizer equals what was captured, bit for bit, the random
generator included; a snapshot of another structure changes nothing; and the process-group
store of a restarted round (``hp_train.runtime``) is never the last round's."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore

from hp_train import runtime
from hp_train.recovery.state import (
    SnapshotMismatchError,
    TrainingState,
    capture,
    optimizer_scalars,
    payload_size,
    restore,
    state_entries,
)

CPU = torch.device("cpu")


def _trained(seed: int, width: int = 6) -> TrainingState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    # A non-tensor entry, as some optimizers keep (a step count as an int).
    first = next(iter(model.parameters()))
    optimizer.state[first]["calls"] = 2 + seed
    return TrainingState(model, optimizer, CPU)


def _capture(state: TrainingState) -> tuple[object, torch.Tensor]:
    entries = state_entries(state)
    buffer = torch.empty(payload_size(entries), dtype=torch.uint8)
    capture(state, entries, buffer)
    return entries, buffer


def test_restore_equals_what_was_captured() -> None:
    saved = _trained(seed=1)
    entries, payload = _capture(saved)
    scalars = optimizer_scalars(saved.optimizer)
    assert scalars == [[0, 0, "calls", 3]]
    expected_draw = torch.rand(4)  # what the generator gives right after the capture

    fresh = _trained(seed=2)  # other weights, other optimizer state, other generator
    torch.rand(7)
    restore(fresh, entries, payload, scalars)  # type: ignore[arg-type]
    assert torch.equal(torch.rand(4), expected_draw)
    for got, want in zip(fresh.model.parameters(), saved.model.parameters(), strict=True):
        assert torch.equal(got, want)
    for p_got, p_want in zip(fresh.model.parameters(), saved.model.parameters(), strict=True):
        got_state, want_state = fresh.optimizer.state[p_got], saved.optimizer.state[p_want]
        assert sorted(got_state) == sorted(want_state)
        for key, value in want_state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got_state[key], value), key
            else:
                assert got_state[key] == value, key


def test_another_structure_is_refused_and_changes_nothing() -> None:
    entries, payload = _capture(_trained(seed=1))
    other = _trained(seed=2, width=7)
    before = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(SnapshotMismatchError, match=r"param/0.weight \(float32, \[6, 4\]\)"):
        restore(other, entries, payload, [])  # type: ignore[arg-type]
    for got, want in zip(other.model.parameters(), before, strict=True):
        assert torch.equal(got, want)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_restarted_round_gets_a_store_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's store still holds the last round's store address (its rank 0 is dead, so
    nobody serves it): rank 1 of the new round reads it, finds nobody, reads again, and joins
    the store the new rank 0 serves, which holds none of the agent store's keys."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    agent_port = _port()
    monkeypatch.setenv("MASTER_PORT", str(agent_port))
    monkeypatch.setattr(runtime, "_STALE_PROBE", timedelta(seconds=0.5))
    agent = TCPStore("127.0.0.1", agent_port, 2, is_master=True, wait_for_workers=False)
    agent.set("hp_train/round_store", f"127.0.0.1:{_port()}")  # the dead round's
    agent.set("default_pg/0//cpu/rank_0", "stale")
    wait = timedelta(seconds=30)
    stores: dict[int, object] = {}

    def rank_1() -> None:
        client = TCPStore("127.0.0.1", agent_port, 2, is_master=False)
        stores[1] = runtime._round_store(client, 1, 2, wait)

    thread = threading.Thread(target=rank_1)
    thread.start()
    threading.Event().wait(1.2)  # rank 1 has found the stale address dead at least once
    client = TCPStore("127.0.0.1", agent_port, 2, is_master=False)
    stores[0] = runtime._round_store(client, 0, 2, wait)
    thread.join(timeout=30)
    first, second = stores[0], stores[1]
    assert isinstance(first, TCPStore)
    assert isinstance(second, TCPStore)
    assert first.port == second.port != agent_port
    first.set("hello", "from rank 0")
    assert second.get("hello") == b"from rank 0"
    assert not second.check(["default_pg/0//cpu/rank_0"])
