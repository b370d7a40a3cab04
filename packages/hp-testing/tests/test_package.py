"""Package surface: lazy exports, picklable errors."""

from __future__ import annotations

import pickle
import subprocess
import sys

import hp_testing
from hp_testing import RankFailure, RankPoolError, RankTimeout


def test_import_is_lazy() -> None:
    code = "import sys, hp_testing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_exports() -> None:
    assert set(hp_testing.__all__) <= set(dir(hp_testing))
    for name in hp_testing.__all__:
        assert getattr(hp_testing, name) is not None


def test_errors_pickle() -> None:
    failure = RankFailure("boom", {1: "tb1", 0: "tb0"}, unanswered=[2])
    copy = pickle.loads(pickle.dumps(failure))
    assert (str(copy), copy.failures, copy.ranks, copy.unanswered) == (
        "boom",
        {1: "tb1", 0: "tb0"},
        (1, 0),
        (2,),
    )
    timeout = RankTimeout("late", [3], 2.5, {3: "stack"})
    copy_t = pickle.loads(pickle.dumps(timeout))
    assert (copy_t.ranks, copy_t.timeout, copy_t.stacks) == ((3,), 2.5, {3: "stack"})
    assert isinstance(copy_t, TimeoutError)
    assert isinstance(copy_t, RankPoolError)
