"""Fixtures shared by hp-train's tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test runs as on a machine without network: any attempt to resolve or connect
    (which libraries swallow when it fails) is recorded and fails the test."""
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("no network in hp-train's data tests")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert not attempts, f"the data pipeline tried the network: {attempts[:3]}"
