"""Tests for tools/check_watched.py on small synthetic packages written to tmp_path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import check_watched

CHECKER = Path(check_watched.__file__).resolve()

WATCHED = """
import torch.distributed as dist
from hp_dtensor.watchdog import watch, watch_async, watch_p2p

def in_context(x, group):
    with watch("all_reduce (mine)", group):
        dist.all_reduce(x, group=group)

def as_argument(x, group):
    return watch_async("all_gather (mine)", group, dist.all_gather_single(x, x, async_op=True))

def assigned_then_watched(x, group):
    work = dist.all_to_all_single(x, x, group=group, async_op=True)
    return watch_async("all_to_all (mine)", group, work)

def marked(ops):
    works = dist.batch_isend_irecv(ops)  # watched: each op's work, by watch_p2p below
    return [watch_p2p("send", 0, 1, w) for w in works]
"""

UNWATCHED = """
import torch.distributed as dist

def bare(x):
    dist.all_reduce(x)

def assigned_never_watched(x):
    work = dist.broadcast(x, src=0, async_op=True)
    work.wait()

def not_a_collective(x):
    return dist.get_rank()
"""


def _write(root: Path, dist_name: str, module: str, text: str) -> None:
    path = root / "packages" / dist_name / "src" / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKER), "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_each_way_of_watching_passes(tmp_path: Path) -> None:
    _write(tmp_path, "hp-a", "hp_a/ok.py", WATCHED)
    assert list(check_watched.find_unwatched(tmp_path)) == []
    result = _run(tmp_path)
    assert result.returncode == 0
    assert "check_watched: OK" in result.stdout


def test_unwatched_calls_are_named_with_their_line(tmp_path: Path) -> None:
    _write(tmp_path, "hp-a", "hp_a/ok.py", WATCHED)
    _write(tmp_path, "hp-a", "hp_a/bad.py", UNWATCHED)
    found = [(str(u.path), u.line, u.call) for u in check_watched.find_unwatched(tmp_path)]
    bad = str(Path("packages/hp-a/src/hp_a/bad.py"))
    assert found == [
        (bad, 5, "dist.all_reduce(x)"),
        (bad, 8, "dist.broadcast(x, src=0, async_op=True)"),
    ]
    result = _run(tmp_path)
    assert result.returncode == 1
    assert f"{bad}:5: dist.all_reduce(x)" in result.stdout
    assert "2 collective(s) the watchdog cannot name" in result.stderr


def test_a_watch_elsewhere_in_the_module_does_not_count(tmp_path: Path) -> None:
    """The name passed to watch_async must be in the same function as the call."""
    text = """
    import torch.distributed as dist
    from hp_dtensor.watchdog import watch_async

    def issue(x):
        work = dist.all_reduce(x, async_op=True)
        return work

    def elsewhere(work):
        return watch_async("all_reduce", None, work)
    """
    _write(tmp_path, "hp-a", "hp_a/split.py", text)
    assert [u.line for u in check_watched.find_unwatched(tmp_path)] == [6]


def test_exempt_packages_are_skipped(tmp_path: Path) -> None:
    exempt = next(iter(check_watched.EXEMPT))
    _write(tmp_path, exempt, "pkg/bad.py", UNWATCHED)
    assert list(check_watched.find_unwatched(tmp_path)) == []
