"""hp_testing: test helpers for hyper-parallel packages (test-only; never a runtime dependency).

* :class:`RankPool` / :func:`run_on_ranks`: persistent pools of gloo rank processes, so
  multi-process tests pay the spawn cost once per session;
* :func:`fake_world`: a fake process group in this process, for world sizes up to hundreds of
  ranks traced with meta tensors;
* :func:`rank`, :func:`world_size`, :func:`assert_all_ranks_equal`: helpers for rank functions;
* a pytest plugin (``hp_testing.pytest_plugin``, loaded automatically once installed) with the
  ``rank_pool`` and ``fake_world`` fixtures.

Importing this package is cheap: torch is imported when one of the names above is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hp_testing.errors import RankFailure, RankPoolError, RankTimeout
    from hp_testing.fake import fake_world
    from hp_testing.helpers import assert_all_ranks_equal, rank, world_size
    from hp_testing.pool import RankPool, close_all_pools, get_pool, run_on_ranks

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "RankFailure": "hp_testing.errors",
    "RankPoolError": "hp_testing.errors",
    "RankTimeout": "hp_testing.errors",
    "fake_world": "hp_testing.fake",
    "assert_all_ranks_equal": "hp_testing.helpers",
    "rank": "hp_testing.helpers",
    "world_size": "hp_testing.helpers",
    "RankPool": "hp_testing.pool",
    "close_all_pools": "hp_testing.pool",
    "get_pool": "hp_testing.pool",
    "run_on_ranks": "hp_testing.pool",
}

__all__ = [
    "RankFailure",
    "RankPool",
    "RankPoolError",
    "RankTimeout",
    "assert_all_ranks_equal",
    "close_all_pools",
    "fake_world",
    "get_pool",
    "rank",
    "run_on_ranks",
    "world_size",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hp_testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
