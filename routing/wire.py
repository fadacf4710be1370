"""What the router and the replicas tell each other, through the router's state actor.

Hints go router -> state actor -> the replica's poll -> the engine (in its own process where it runs there);
statistics go engine -> replica -> state actor -> routers. Plain frozen dataclasses: they cross Ray's pickling and
the engine process's pipe, and every side imports them without Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum


class HintKind(str, Enum):
    WAITING = "waiting"  # a request waits in the router, near its front, for this replica: load its adapter
    AHEAD = "ahead"  # a request far back in the router's queue: fetch its remote adapter to the node, no further
    INCOMING = "incoming"  # a request waits at another, saturated replica and may spread here: keep its adapter
    WITHDRAWN = "withdrawn"  # a request hinted WAITING here went to another replica after all


@dataclass(frozen=True)
class Hint:
    adapter_id: str
    request_id: str | None = None  # Serve's internal request id, which the request brings to the engine; None: none
    kind: HintKind = HintKind.WAITING


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's report: what the router places by, and what operators read in GET /v1/debug/replicas."""

    resident: tuple[str, ...] = ()  # adapters in a device slot
    loading: tuple[str, ...] = ()  # adapters on their way to a device slot
    queued: tuple[str, ...] = ()  # adapters of requests waiting in the engine
    free_slots: int = 0
    hint_room: int | None = None  # distinct adapters the router may hint here (None: no limit)
    ongoing: int = 0  # calls the replica is serving, as Serve counts them against max_ongoing_requests
    running: int = 0  # engine requests in the batch
    waiting: int = 0  # engine requests waiting for a place in the batch
    pinned_slots: int = 0
    host_cache_bytes: int = 0
    host_cache_adapters: int = 0  # max-rank adapters the host cache holds
    device: str = ""
    invariants: str = "unchecked"  # the last full invariant check: "ok" or "violated: ..."
    arrivals: dict[str, int] = field(default_factory=dict)  # arrival and hint counters
    hint_lead_seconds: dict = field(default_factory=dict)  # histogram of hint-to-arrival times
    step_timing: dict = field(default_factory=dict)
    node_cache: dict | None = None  # the node cache's counters, where the replica serves remote adapters
    rss_bytes: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # adapter -> why the engine refused its files

    def to_dict(self) -> dict:
        """For JSON, and for Serve's routing stats, which its controller keeps without importing this module."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ReplicaStats:
        """From to_dict's output (Serve's routing stats); keys of another version are dropped."""
        names = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
        return cls(**values)


@dataclass(frozen=True)
class ClusterView:
    """The state actor's view, which routers place by."""

    epoch: str  # changes when Serve recreates the actor
    replicas: dict[str, ReplicaStats]  # replica's unique id -> its last stats, for replicas that report

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "replicas": {uid: stats.to_dict() for uid, stats in self.replicas.items()}}


@dataclass(frozen=True)
class SyncReply:
    """The state actor's answer to a replica's report: its hints, and the adapter registry where it changed."""

    epoch: str  # changes when Serve recreates the actor
    version: int  # the registry's version
    hints: tuple[Hint, ...] = ()  # in the order the router sent them
    adapters: dict[str, str] | None = None  # name -> path: the whole registry, where the replica's copy is stale
