"""pytest plugin of hp_testing (entry point ``pytest11``: loaded automatically once installed).

Fixtures:

``rank_pool`` (session)
    A callable ``get(world_size) -> RankPool``: the session's gloo pool of that many ranks,
    created on first use, shared with :func:`hp_testing.run_on_ranks`, closed at session end.
    Tests that use it are marked ``multiprocess``.
``fake_world`` (function)
    The :func:`hp_testing.fake_world` context manager factory:
    ``with fake_world(768, rank=5) as group: ...``. At teardown, a default process group
    the test left initialized is destroyed, so it cannot leak into later tests.

Disable with ``-p no:hp_testing``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch.distributed as dist

    from hp_testing.pool import RankPool

_MARKER = "multiprocess"
_MARKER_LINE = f"{_MARKER}: spawns worker processes (gloo process groups, rank pools)"


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``multiprocess`` marker unless the project already does."""
    declared = config.getini("markers")
    if not any(str(line).split(":", 1)[0].strip() == _MARKER for line in declared):
        config.addinivalue_line("markers", _MARKER_LINE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses ``rank_pool`` as ``multiprocess``."""
    for item in items:
        if "rank_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(_MARKER)


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """``get(world_size) -> RankPool``: session-wide gloo pools, closed at session end."""
    from hp_testing.pool import close_all_pools, get_pool

    def get(world_size: int) -> RankPool:
        return get_pool(world_size)

    yield get
    close_all_pools()


@pytest.fixture
def fake_world() -> Iterator[Callable[..., AbstractContextManager[dist.ProcessGroup]]]:
    """The :func:`hp_testing.fake_world` context manager (see its docs)."""
    import torch.distributed as dist

    from hp_testing.fake import fake_world as factory

    yield factory
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
