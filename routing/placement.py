"""Cluster placement policy: which replica takes a pending request, and whether to hint it.

A pure function over a snapshot of the replicas, so policies can be compared in benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass

# No room, no hint: a read past the host cache would evict an adapter in use.
MIN_HINT_ROOM = 0


@dataclass(frozen=True)
class ReplicaLoad:
    uid: str
    ongoing: int  # requests the replica is serving or queueing
    capacity: int  # max ongoing requests it accepts
    resident: frozenset = frozenset()
    loading: frozenset = frozenset()
    queued: frozenset = frozenset()
    free_slots: int = 0
    hint_room: int | None = None  # distinct adapters the router may hint here; None: no limit (an older replica)

    @property
    def is_full(self) -> bool:
        return self.ongoing >= self.capacity

    def holds(self, adapter_id: str) -> bool:
        return adapter_id in self.resident or adapter_id in self.loading or adapter_id in self.queued


@dataclass(frozen=True)
class Placement:
    uid: str
    outcome: str  # "affinity" | "spread" | "cold" | "base"
    must_wait: bool  # the replica is full: the request stays pending, so hint the adapter now
    spread_to: str | None = None  # waiting at a saturated holder: the replica it would spread to


def place(adapter_id: str | None, replicas: list[ReplicaLoad], waited_s: float, spread_after_s: float,
          recent: frozenset = frozenset(), rng: random.Random | None = None,
          waiting_for: str | None = None) -> Placement:
    """Prefer a replica that holds the adapter (or was just sent it), unless it is saturated and the
    request has waited spread_after_s; otherwise the least-loaded replica, preferring free slots.

    waiting_for: the replica this request already waits for. While it must wait anyway it keeps waiting
    there, so the hint it was given (and the read that hint started) stays of use. Without this, a cold request
    in front of equally full replicas would draw a new one on every routing attempt and leave a hint at each."""
    rng = rng or random
    if not replicas:
        raise ValueError("no replicas to place on")
    placement = _place(adapter_id, replicas, waited_s, spread_after_s, recent, rng)
    if placement.must_wait and waiting_for is not None and waiting_for != placement.uid and \
            any(r.uid == waiting_for for r in replicas):
        return Placement(waiting_for, placement.outcome, True,
                         spread_to=placement.spread_to if placement.spread_to != waiting_for else None)
    return placement


def _place(adapter_id, replicas, waited_s, spread_after_s, recent, rng) -> Placement:
    def load(r: ReplicaLoad):
        return (r.ongoing / max(r.capacity, 1), rng.random())

    if adapter_id is None:
        best = min(replicas, key=load)
        return Placement(best.uid, "base", best.is_full)
    holders = [r for r in replicas if r.holds(adapter_id) or r.uid in recent]
    others = [r for r in replicas if r not in holders]
    if holders:
        best = min(holders, key=lambda r: (adapter_id not in r.resident, *load(r)))
        if not best.is_full:
            return Placement(best.uid, "affinity", False)
        free = [r for r in others if not r.is_full]
        target = min(free, key=lambda r: (r.free_slots == 0, *load(r))) if free else None
        if target is not None and waited_s >= spread_after_s:
            return Placement(target.uid, "spread", False)
        return Placement(best.uid, "affinity", True, spread_to=target.uid if target else None)
    target = min(replicas, key=lambda r: (r.is_full, r.free_slots == 0, *load(r)))
    return Placement(target.uid, "cold", target.is_full)


def hint_room(host_adapters: int, busy_adapters: int) -> int:
    """How many distinct adapters a replica takes hints for: what its host cache holds at max_rank, less the
    adapters its own running and queued requests use. Hints past that room read adapters that evict those read
    for requests due sooner, so those are read from disk twice. A replica whose host cache its own requests
    fill takes no hint."""
    return max(MIN_HINT_ROOM, host_adapters - busy_adapters)


def can_hint(adapter_id: str, hinted_adapters: Collection[str], room: int | None) -> bool:
    """May the router hint one more waiting request for adapter_id at a replica, whose live waiting hints (sent,
    not yet consumed, withdrawn or expired) are for hinted_adapters? An adapter already hinted there costs no
    room: the replica reads it once. A request held back is hinted on a later routing attempt, once room frees."""
    return room is None or adapter_id in hinted_adapters or len(set(hinted_adapters)) < room
