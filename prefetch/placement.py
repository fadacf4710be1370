"""Cluster placement policy: which replica takes a pending request, and whether to hint it.

A pure function over a snapshot of the replicas, so policies can be compared in benchmarks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    uid: str
    ongoing: int  # requests the replica is serving or queueing
    capacity: int  # max ongoing requests it accepts
    resident: frozenset = frozenset()
    loading: frozenset = frozenset()
    queued: frozenset = frozenset()
    free_slots: int = 0

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
          recent: frozenset = frozenset(), rng: random.Random | None = None) -> Placement:
    """Prefer a replica that holds the adapter (or was just sent it), unless it is saturated and the
    request has waited spread_after_s; otherwise the least-loaded replica, preferring free slots."""
    rng = rng or random
    if not replicas:
        raise ValueError("no replicas to place on")

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
