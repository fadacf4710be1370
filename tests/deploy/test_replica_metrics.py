"""The replica exports the engine's cumulative arrival counters to Prometheus as deltas (no Ray needed)."""

import asyncio
from types import SimpleNamespace

from deploy import metrics
from deploy import replica as replica_module


def test_arrival_counters_are_exported_once_as_deltas(monkeypatch):
    sent = []

    def counter(name):
        return lambda: SimpleNamespace(inc=lambda n, tags: sent.append((name, n, tags)), observe=lambda s: None,
                                       set=lambda value, tags: None)

    for name in ("residency", "hinted_arrivals", "stalls", "slots"):
        monkeypatch.setattr(metrics, name, counter(name))
    snapshot = {**dict.fromkeys(replica_module.ARRIVAL_KINDS | replica_module.HINTED_TIERS, 0), "stalls": [],
                **{f"slots_{state}": 0 for state in ("ready", "loading", "pinned", "total")}}

    async def call(fn):
        return dict(snapshot)

    replica = replica_module.LoRAReplica.__new__(replica_module.LoRAReplica)
    replica.engine = SimpleNamespace(call=call)
    replica._reported = dict.fromkeys(replica_module.ARRIVAL_KINDS | replica_module.HINTED_TIERS, 0)
    snapshot.update(hint_hits=2, misses=1, hinted_in_host=1, hinted_from_disk=3)
    asyncio.run(replica._export_metrics())
    asyncio.run(replica._export_metrics())  # nothing new: nothing sent again
    assert sorted(sent) == [("hinted_arrivals", 1, {"tier": "host"}), ("hinted_arrivals", 3, {"tier": "disk"}),
                            ("residency", 1, {"kind": "miss"}), ("residency", 2, {"kind": "hit"})]


def test_graceful_shutdown_stops_the_engine_once():
    """Serve calls __del__ after draining a replica; garbage collection may call it again."""
    calls = []
    replica = replica_module.LoRAReplica.__new__(replica_module.LoRAReplica)
    replica.engine = SimpleNamespace(shutdown=lambda: calls.append("engine"))
    replica._sync_task = SimpleNamespace(cancel=lambda: calls.append("sync"))
    replica.__del__()
    replica.__del__()
    assert calls == ["sync", "engine"]
    half_built = replica_module.LoRAReplica.__new__(replica_module.LoRAReplica)
    half_built.__del__()  # __init__ failed before the engine loop started: nothing to stop
