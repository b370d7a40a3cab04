"""Planning a recovery: which step a restarted job continues from and where each rank's state
comes from; pure functions, no torch, no files.

Every rank snapshots its own state (its shards of the model and optimizer, the data position,
the RNG states) into its host's snapshot folder and sends a replica to its *buddy*, a rank of
another host (:func:`buddy_ranks`). After a restart every rank lists what its host's folder
holds (:class:`Holding`), the lists are gathered, and every rank computes the same
:class:`RecoveryPlan` from them (:func:`plan_recovery`):

* **step**: the newest step for which every rank's snapshot is held somewhere (its own host's
  folder or a replica on another host), provided it is not older than the newest disk
  checkpoint; otherwise the disk checkpoint (or, with neither, a fresh start);
* **source per rank**: a holding on the rank's own host if there is one (read from the folder,
  the rank's own snapshot before a replica of it), else one on another host, which a rank
  there reads and sends over the process group (a *transfer*); senders are balanced (the rank
  of that host with the fewest transfers so far sends, the lowest rank on a tie).

Postconditions (tested): every rank has exactly one source, at the plan's step; a local source
is on the rank's host; a transfer's sender is on the host of the holding it sends, never the
receiver itself; no holding that failed verification (``excluded``) is used; the plan is a
function of its inputs only (every rank computes the same one).

Hosts are opaque strings: two ranks are on the same host when they see the same snapshot
folder (hp-train names a host by its hostname and the folder's path).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Holding",
    "RankSource",
    "RecoveryPlan",
    "buddy_ranks",
    "plan_recovery",
]

#: A snapshot a rank wrote itself, or a replica of another rank's that it received.
HoldingKind = Literal["own", "replica"]


@dataclass(frozen=True, order=True)
class Holding:
    """One verified-looking snapshot in one host's folder: ``owner``'s state after ``step``
    steps (its header read; its bytes are checked when it is used).

    Attributes:
        owner: the rank whose state it is.
        step: the steps done when it was taken.
        host: the host whose folder holds it.
        kind: ``"own"`` (written by ``owner`` on that host) or ``"replica"`` (received from
            ``owner``, on another host).
    """

    owner: int
    step: int
    host: str
    kind: HoldingKind


@dataclass(frozen=True)
class RankSource:
    """Where one rank's state comes from.

    Attributes:
        rank: the rank that loads it.
        holding: the snapshot it loads.
        sender: the rank that reads the holding and sends it (None: ``rank`` reads it from its
            own host's folder).
    """

    rank: int
    holding: Holding
    sender: int | None

    @property
    def local(self) -> bool:
        """Read from the rank's own host's folder."""
        return self.sender is None


@dataclass(frozen=True)
class RecoveryPlan:
    """What a restarted job loads.

    Attributes:
        source: ``"snapshot"`` (``step`` from the snapshots, per ``ranks``), ``"disk"`` (the
            newest disk checkpoint that verifies; ``step`` is the newest listed one's) or
            ``"none"`` (a fresh start).
        step: the step the job continues from (0 for ``"none"``).
        ranks: per rank (by index) its :class:`RankSource`; empty unless ``"snapshot"``.
        why: one sentence saying why this source (for the start-up message).
    """

    source: Literal["snapshot", "disk", "none"]
    step: int
    ranks: tuple[RankSource, ...]
    why: str

    def transfers(self) -> tuple[RankSource, ...]:
        """The sources fetched over the process group, in rank order (every rank posts its
        sends and receives in this order)."""
        return tuple(r for r in self.ranks if r.sender is not None)

    def describe(self) -> str:
        """``step 41 from memory snapshots (own: 0, 1, 3; buddy replicas: 2 from rank 0)``."""
        if self.source != "snapshot":
            return self.why
        own = [str(r.rank) for r in self.ranks if r.local and r.holding.kind == "own"]
        kept = [str(r.rank) for r in self.ranks if r.local and r.holding.kind == "replica"]
        sent = [f"{r.rank} from rank {r.sender}" for r in self.transfers()]
        parts = [f"own: {', '.join(own)}"] if own else []
        if kept:
            parts.append(f"replicas on the rank's host: {', '.join(kept)}")
        if sent:
            parts.append(f"buddy replicas: {', '.join(sent)}")
        return f"step {self.step} from memory snapshots ({'; '.join(parts)})"


def buddy_ranks(hosts: Sequence[str]) -> tuple[int | None, ...]:
    """Each rank's buddy: the rank that keeps a replica of its snapshots, on the next host in
    a ring of the hosts (ordered by their lowest rank), at the same index among that host's
    ranks (modulo their number); None for every rank when there is only one host.

    ``hosts[r]`` is rank ``r``'s host. Postconditions: a buddy is always on another host; with
    hosts of equal size every rank is the buddy of exactly one rank (a permutation)."""
    members: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        members.setdefault(host, []).append(rank)
    order = list(members)  # first appearance = lowest rank first
    if len(order) < 2:
        return tuple(None for _ in hosts)
    buddies: list[int | None] = []
    for rank, host in enumerate(hosts):
        index = members[host].index(rank)
        following = members[order[(order.index(host) + 1) % len(order)]]
        buddies.append(following[index % len(following)])
    return tuple(buddies)


def _usable_steps(world: int, holdings: Collection[Holding]) -> list[int]:
    """The steps at which every rank's snapshot is held somewhere, newest first."""
    owners: dict[int, set[int]] = {}
    for h in holdings:
        owners.setdefault(h.step, set()).add(h.owner)
    wanted = set(range(world))
    return sorted((s for s, have in owners.items() if have >= wanted), reverse=True)


def plan_recovery(
    hosts: Sequence[str],
    holdings: Collection[Holding],
    disk_step: int | None,
    excluded: Collection[Holding] = (),
) -> RecoveryPlan:
    """The recovery of a job whose rank ``r`` runs on ``hosts[r]``, from the snapshots
    ``holdings`` (every host's, duplicates allowed) less ``excluded`` (found damaged), and the
    newest disk checkpoint's step (``disk_step``, None: there is none); see the module
    docstring for the rules and postconditions."""
    world = len(hosts)
    usable = sorted(set(holdings) - set(excluded))
    steps = _usable_steps(world, usable)
    if not steps or (disk_step is not None and disk_step > steps[0]):
        if disk_step is not None:
            newer = f" (newer than any complete set of snapshots, {steps[0]})" if steps else ""
            why = f"step {disk_step} from the newest disk checkpoint{newer}"
            return RecoveryPlan("disk", disk_step, (), why)
        return RecoveryPlan("none", 0, (), "no snapshot or checkpoint: a new run")
    step = steps[0]
    at_step = [h for h in usable if h.step == step]
    sends: Counter[int] = Counter()
    ranks = []
    for rank in range(world):
        mine = [h for h in at_step if h.owner == rank]
        here = [h for h in mine if h.host == hosts[rank]]
        if here:
            # The rank's own snapshot before a replica of it that happens to be here.
            ranks.append(RankSource(rank, min(here, key=lambda h: h.kind != "own"), None))
            continue
        holding = mine[0]
        senders = [r for r in range(world) if hosts[r] == holding.host]
        if not senders:
            raise ValueError(f"{holding} is held on host {holding.host!r}, which has no rank")
        sender = min(senders, key=lambda r: (sends[r], r))
        sends[sender] += 1
        ranks.append(RankSource(rank, holding, sender))
    return RecoveryPlan("snapshot", step, tuple(ranks), f"step {step} from memory snapshots")
