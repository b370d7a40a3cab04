"""The stall-or-crash decision of :func:`hp_dtensor.collective_errors.diagnose`, on reports
written here: a lost connection blames only the ranks that are gone, never from counts; a
timeout blames the ranks whose counts are behind; anything else passes."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from hp_dtensor.collective_errors import (
    CollectiveError,
    CollectiveTimeoutError,
    Failure,
    PeerLostError,
    PeerReport,
    diagnose,
)

RESET = (
    "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:25492: "
    "Connection reset by peer"
)
TIMED_OUT = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms"

FAILURE = Failure(
    collective="all_gather (FSDP parameters)",
    group="'dp_shard' (ranks [0, 1, 2, 3])",
    group_key="g1",
    ranks=(0, 1, 2, 3),
    rank=0,
    count=3617,
    elapsed_s=0.01,
    timeout_s=1800.0,
    error=RESET,
)


def _peer(count: int, process: str = "running", *, stale: bool = False) -> PeerReport:
    return PeerReport(
        count=count,
        last="all_gather (FSDP parameters)",
        now=None,
        age_s=0.4,
        stale=stale,
        process=process,  # type: ignore[arg-type]
        where="pid 4242 on host-a",
    )


def test_a_crash_blames_the_exited_rank_only_whatever_the_counts() -> None:
    """Rank 2 exited; ranks 1 and 3 run but their published counts lag by ~30 (a period at a
    fast collective rate): only rank 2 is named, and as exited, not as not arriving."""
    peers = {1: _peer(3590), 2: _peer(3587, "exited"), 3: _peer(3601)}
    error = diagnose(FAILURE, peers)
    assert isinstance(error, PeerLostError)
    assert error.gone == (2,)
    assert error.silent == ()
    text = str(error)
    assert "rank 2 exited while the group was in it" in text
    assert "rank 2: exited (pid 4242 on host-a no longer runs)" in text
    assert "did not arrive" not in text
    assert "timeout" not in text
    assert "rank 1:" not in text
    assert "rank 3:" not in text


def test_a_crash_on_another_host_names_the_rank_that_stopped_reporting() -> None:
    peers = {1: _peer(3616, "unknown"), 2: _peer(3600, "unknown", stale=True), 3: None}
    error = diagnose(FAILURE, peers)
    assert isinstance(error, PeerLostError)
    assert error.gone == ()
    assert error.silent == (2, 3)
    assert "ranks 2, 3 stopped reporting" in str(error)


def test_a_lost_connection_with_every_rank_running_blames_none() -> None:
    failed = replace(_peer(3617), failed="all_reduce over group 'tp' (#12 there): reset")
    error = diagnose(FAILURE, {1: _peer(1), 2: failed, 3: _peer(2)})
    assert isinstance(error, PeerLostError)
    assert error.gone == ()
    assert error.silent == ()
    assert "every rank of the group is still running" in str(error)
    assert "rank 2: running, its own collective failed: all_reduce over group 'tp'" in str(error)


def test_a_timeout_blames_the_ranks_whose_counts_are_behind() -> None:
    failure = replace(FAILURE, elapsed_s=1800.2, error=TIMED_OUT)
    peers = {1: _peer(3617), 2: _peer(3616, stale=True), 3: None}
    error = diagnose(failure, peers)
    assert isinstance(error, CollectiveTimeoutError)
    assert error.missing == (2, 3)
    text = str(error)
    assert text.startswith(
        "all_gather (FSDP parameters) over group 'dp_shard' (ranks [0, 1, 2, 3]) did not "
        "complete within the 1800 s timeout (rank 0, its collective #3617 over this group, "
        "failed after 1800.2 s): ranks 2, 3 of the group did not arrive"
    )
    assert "its last report is 0.4 s old (dead, or stuck holding the GIL?)" in text
    assert text.endswith("backend error: " + TIMED_OUT)


def test_a_lost_connection_at_the_timeout_is_a_timeout() -> None:
    """A peer that gave up at its own timeout closes its connection: still a stall."""
    failure = replace(FAILURE, elapsed_s=1700.0)
    error = diagnose(failure, {1: _peer(3617), 2: _peer(3616, "exited"), 3: _peer(3617)})
    assert isinstance(error, CollectiveTimeoutError)
    assert error.missing == (2,)
    assert "it has exited since (pid 4242 on host-a no longer runs)" in str(error)


def test_other_errors_pass() -> None:
    failure = replace(FAILURE, error="RuntimeError: shape mismatch [4] vs [8]")
    assert diagnose(failure, {1: _peer(0, "exited")}) is None


@pytest.mark.parametrize("kind", ["lost", "timeout"])
def test_the_errors_pickle_with_their_attributes(kind: str) -> None:
    failure = FAILURE if kind == "lost" else replace(FAILURE, error=TIMED_OUT)
    error = diagnose(failure, {1: _peer(1, "exited"), 2: _peer(3617), 3: _peer(3617)})
    assert isinstance(error, CollectiveError)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    assert vars(back) == vars(error)
