"""Residency counters: hits, stalls, bytes and seconds per tier, evictions and wasted prefetches."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

STALL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict:
        buckets = {f"le_{b:g}": c for b, c in zip(self.bounds, self.counts)}
        buckets["le_inf"] = self.counts[-1]
        return {"count": self.count, "sum": self.total, "buckets": buckets}


@dataclass
class PrefetchMetrics:
    hint_hits: int = 0  # adapter resident when the request was first schedulable
    inflight_hits: int = 0  # adapter still loading, but the load was already under way
    misses: int = 0  # adapter not even loading: the request had to start its own load
    # Arrivals of requests the router hinted here while they waited (they consume a waiting hint), by where
    # their adapter was: in a slot (ready or loading), in the host cache (cached or being read), or nowhere.
    hinted_on_device: int = 0
    hinted_in_host: int = 0
    hinted_from_disk: int = 0  # local adapters: from their folder; remote ones: from the node's disk cache
    hinted_from_store: int = 0  # a remote adapter not yet on the node
    hints_received: int = 0
    hints_late: int = 0  # received just after an unhinted arrival of their adapter: that request's, dropped
    hints_duplicate: int = 0  # a second hint for a request already hinted here: ignored (the router sends one)
    stalls: Histogram = field(default_factory=lambda: Histogram(STALL_BUCKETS_S))
    loads_started: int = 0
    load_failures: int = 0
    evictions: int = 0
    wasted_prefetches: int = 0  # loaded, then evicted before any request used it
    wasted_prefetch_bytes: int = 0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    load_seconds: deque = field(default_factory=lambda: deque(maxlen=4096))  # request to ready, per load
    unreported_stalls: deque = field(default_factory=lambda: deque(maxlen=4096))  # for an exporter to drain

    def count_hint(self, outcome: str) -> None:
        """outcome: what HintBook.add made of a hint."""
        if outcome == "duplicate":
            self.hints_duplicate += 1
            return
        if outcome == "upgraded":  # the same request, hinted far back before: counted then
            return
        self.hints_received += 1
        if outcome == "late":
            self.hints_late += 1

    def observe_stall(self, seconds: float) -> None:
        self.stalls.observe(seconds)
        self.unreported_stalls.append(seconds)

    def record_h2d(self, nbytes: int, seconds: float) -> None:
        self.h2d_bytes += nbytes
        self.h2d_seconds += seconds

    def snapshot(self, host_stats: dict) -> dict:
        return {
            "hint_hits": self.hint_hits,
            "inflight_hits": self.inflight_hits,
            "misses": self.misses,
            "hinted_on_device": self.hinted_on_device,
            "hinted_in_host": self.hinted_in_host,
            "hinted_from_disk": self.hinted_from_disk,
            "hinted_from_store": self.hinted_from_store,
            "hints_received": self.hints_received,
            "hints_late": self.hints_late,
            "hints_duplicate": self.hints_duplicate,
            "stall_seconds": self.stalls.as_dict(),
            "loads_started": self.loads_started,
            "load_failures": self.load_failures,
            "evictions": self.evictions,
            "wasted_prefetches": self.wasted_prefetches,
            "wasted_prefetch_bytes": self.wasted_prefetch_bytes,
            "load_seconds": {  # from a load's start (disk read included) to its slot being ready
                "count": len(self.load_seconds),
                "p50": sorted(self.load_seconds)[len(self.load_seconds) // 2] if self.load_seconds else None,
                "max": max(self.load_seconds, default=None),
            },
            "tiers": {
                "disk_to_host": {
                    "bytes": host_stats["read_bytes"],
                    "seconds": host_stats["read_seconds"],
                    "reads": host_stats["reads"],
                    "cache_hits": host_stats["hits"],
                    "cache_evictions": host_stats["evictions"],
                },
                "host_to_device": {
                    "bytes": self.h2d_bytes,
                    "seconds": self.h2d_seconds,
                    "gb_per_s": self.h2d_bytes / self.h2d_seconds / 1e9 if self.h2d_seconds else None,
                },
            },
        }
