"""The recovery planner (``hp_train.recovery.plan``) and the snapshot files
(``hp_train.recovery.snapshot_file``): postconditions checked on random inputs, each against a
statement of the rule written here, and the files against damage of every kind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hp_train.recovery.plan import Holding, buddy_ranks, plan_recovery
from hp_train.recovery.snapshot_file import (
    Entry,
    SnapshotCorruptError,
    SnapshotHeader,
    list_holdings,
    prune,
    read_snapshot,
    remove_other_runs,
    snapshot_folder,
    write_snapshot,
)


def _random_job(rng: random.Random) -> tuple[list[str], list[Holding], int | None]:
    world = rng.randint(1, 9)
    n_hosts = rng.randint(1, min(world, 4))
    hosts = [f"h{rng.randrange(n_hosts)}" for _ in range(world)]
    holdings = []
    for owner in range(world):
        for step in rng.sample(range(1, 8), rng.randint(0, 3)):
            holdings.append(Holding(owner, step, rng.choice(sorted(set(hosts))), "own"))
            if rng.random() < 0.5:
                holdings.append(Holding(owner, step, rng.choice(sorted(set(hosts))), "replica"))
    disk = rng.choice([None, 0, 3, 5, 9])
    return hosts, holdings, disk


def test_plan_postconditions_on_random_jobs() -> None:
    """For 3,000 random jobs: the step is the newest at which every rank's snapshot is held
    (found here by brute force over the steps), unless the disk checkpoint is newer; every
    rank gets one source at that step; a local source is on the rank's host and one is taken
    whenever one exists; a sender is on the holding's host and never the receiver; excluded
    holdings are never used."""
    rng = random.Random(42)
    for _ in range(3000):
        hosts, holdings, disk = _random_job(rng)
        excluded = [h for h in holdings if rng.random() < 0.15]
        plan = plan_recovery(hosts, holdings, disk, excluded)
        usable = [h for h in holdings if h not in excluded]
        world = len(hosts)
        complete = [
            s
            for s in range(1, 8)
            if all(any(h.owner == r and h.step == s for h in usable) for r in range(world))
        ]
        newest = max(complete, default=None)
        if newest is None or (disk is not None and disk > newest):
            assert plan.source == ("none" if disk is None else "disk")
            assert plan.step == (disk or 0)
            assert plan.ranks == ()
            continue
        assert plan.source == "snapshot"
        assert plan.step == newest
        assert [s.rank for s in plan.ranks] == list(range(world))
        for source in plan.ranks:
            h = source.holding
            assert h in usable
            assert (h.owner, h.step) == (source.rank, newest)
            here = [
                u
                for u in usable
                if (u.owner, u.step, u.host) == (source.rank, newest, hosts[source.rank])
            ]
            if here:
                assert source.sender is None
                assert h.host == hosts[source.rank]
                if any(u.kind == "own" for u in here):
                    assert h.kind == "own"
            else:
                assert source.sender is not None
                assert source.sender != source.rank
                assert hosts[source.sender] == h.host
        assert plan_recovery(hosts, list(reversed(holdings)), disk, excluded) == plan


def test_plan_balances_senders() -> None:
    """Host b's four ranks lost their folder; host a's two ranks send two each."""
    hosts = ["a", "a", "b", "b", "b", "b"]
    holdings = [Holding(r, 7, "a", "own" if r < 2 else "replica") for r in range(6)]
    plan = plan_recovery(hosts, holdings, None)
    senders = [s.sender for s in plan.transfers() if s.sender is not None]
    assert sorted(senders) == [0, 0, 1, 1]
    assert "buddy replicas: 2 from rank 0, 3 from rank 1, 4 from rank 0, 5 from rank 1" in (
        plan.describe()
    )


def test_buddies_are_on_another_host_and_a_permutation() -> None:
    """Each rank's buddy is on the next host of the ring at the same local index; one host: no
    buddies."""
    for per_host, n_hosts in [(1, 2), (2, 2), (4, 3), (3, 5)]:
        hosts = [f"h{r // per_host}" for r in range(per_host * n_hosts)]
        buddies = buddy_ranks(hosts)
        for rank, buddy in enumerate(buddies):
            assert buddy is not None
            assert hosts[buddy] != hosts[rank]
            assert buddy == (rank + per_host) % len(hosts)
        assert sorted(b for b in buddies if b is not None) == list(range(len(hosts)))
    assert buddy_ranks(["h", "h", "h"]) == (None, None, None)


def _header(owner: int, step: int, run: str = "run-a", world: int = 2) -> SnapshotHeader:
    entries = (Entry("param/w", "float32", (2, 3), 0, 24), Entry("rng/cpu", "uint8", (5,), 64, 5))
    return SnapshotHeader(run, owner, world, step, entries, {"data": {"next": step}})


def test_snapshot_round_trip_and_damage(tmp_path: Path) -> None:
    """What is written reads back equal; a flipped byte, a truncated or longer payload, a
    missing payload or a header that does not parse is refused naming the file; temporary
    files of a killed writer are not listed."""
    payload = bytes(range(69))
    folder = snapshot_folder(tmp_path, "own", 1)
    head = write_snapshot(folder, _header(1, 4), payload)
    header, data = read_snapshot(head)
    assert bytes(data) == payload
    assert (header.owner, header.step, header.size) == (1, 4, 69)
    assert header.entries == _header(1, 4).entries
    assert header.extras == {"data": {"next": 4}}
    snap = head.with_suffix(".snap")

    damaged = bytearray(payload)
    damaged[30] ^= 1
    snap.write_bytes(bytes(damaged))
    with pytest.raises(SnapshotCorruptError, match=r"step_00000004\.snap: SHA-256 differs"):
        read_snapshot(head)
    snap.write_bytes(payload[:-1])
    with pytest.raises(SnapshotCorruptError, match="68 bytes, its header says 69"):
        read_snapshot(head)
    snap.write_bytes(payload + b"x")
    with pytest.raises(SnapshotCorruptError, match="70 bytes"):
        read_snapshot(head)
    snap.unlink()
    with pytest.raises(SnapshotCorruptError, match="unreadable"):
        read_snapshot(head)
    head.write_text("{not json")
    with pytest.raises(SnapshotCorruptError, match="unreadable header"):
        read_snapshot(head)

    (folder / "step_00000009.snap.tmp").write_bytes(b"half")
    (folder / "step_00000009.json.tmp").write_text("{}")
    assert [x.holding.step for x in list_holdings(tmp_path, "h", "run-a", 2)] == []


def test_listing_keeps_this_run_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    """Listing returns this run's snapshots at this world size only; pruning keeps the newest
    ``keep`` and removes a killed writer's leftovers; removing other runs' snapshots leaves
    this run's."""
    own, replica = snapshot_folder(tmp_path, "own", 0), snapshot_folder(tmp_path, "replica", 1)
    for step in (3, 4, 5):
        write_snapshot(own, _header(0, step), b"abc")
    write_snapshot(replica, _header(1, 5), b"abc")
    write_snapshot(replica, _header(1, 6, run="run-b"), b"abc")
    write_snapshot(replica, _header(1, 7, world=4), b"abc")
    found = sorted(x.holding for x in list_holdings(tmp_path, "h", "run-a", 2))
    assert found == [
        Holding(0, 3, "h", "own"),
        Holding(0, 4, "h", "own"),
        Holding(0, 5, "h", "own"),
        Holding(1, 5, "h", "replica"),
    ]
    (own / "step_00000006.snap.tmp").write_bytes(b"half")
    prune(own, 2)
    assert sorted(p.name for p in own.iterdir()) == [
        "step_00000004.json",
        "step_00000004.snap",
        "step_00000005.json",
        "step_00000005.snap",
    ]
    remove_other_runs(tmp_path, "run-a", [0, 1])
    assert sorted(p.name for p in replica.iterdir()) == [
        "step_00000005.json",
        "step_00000005.snap",
        "step_00000007.json",
        "step_00000007.snap",
    ]
