"""Fetches of remote adapters into the node cache ahead of their reads: nearest need first, within half the cache,
`fetch_workers` at once, and those of requests already at the replica never behind the others."""

from __future__ import annotations

import threading

from adapter_helpers import make_adapter
from app.adapters.node_cache import NodeCache
from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME
import store_helpers
from store_helpers import wait_for_fetches
from traffic import wait_for

moto_server, s3, registries = store_helpers.moto_server, store_helpers.s3, store_helpers.registries  # fixtures


def test_fetch_ahead_nearest_first_within_half_the_cache(s3, registries, tmp_path):
    make_adapter(tmp_path / "here" / "here", r=4)
    for name in "abcd":
        make_adapter(tmp_path / "local" / name, r=4)
        s3.put_folder(tmp_path / "local" / name, f"adapters/{name}")
    weights = (tmp_path / "local" / "a" / WEIGHTS_NAME).stat().st_size
    entry = weights + (tmp_path / "local" / "a" / CONFIG_NAME).stat().st_size
    cache = NodeCache(tmp_path / "cache", 4 * weights + 1)  # half of it: two adapters' weights
    registry = registries([tmp_path / "here", s3.uri("adapters")], cache=cache, fetch_workers=1)
    registry.register("here", "here")
    for name in "abcd":
        registry.register(name, s3.uri("adapters", name))
    assert registries([s3.uri("adapters")]).fetch_ahead(["a"]) == 0  # no node cache: nothing to fetch into
    demand = ["c", "here", "unknown", "a", "c", "d", "b"]
    assert registry.fetch_ahead(demand) == 1  # one worker: the nearest starts, the next once it ends
    assert registry.is_fetching("c") and registry.fetch_ahead(demand) == 0
    wait_for_fetches(registry)
    assert registry.fetch_ahead(demand) == 1 and registry.is_fetching("a")
    wait_for_fetches(registry)
    assert registry.fetch_ahead(demand) == 0  # d and b lie past half the cache
    assert [registry.on_node(name) for name in ("a", "b", "c", "d", "here")] == [True, False, True, False, True]
    snapshot = registry.node_snapshot()
    ahead = (snapshot["fetched_ahead"], snapshot["fetched_ahead_bytes"], snapshot["fetched_ahead_used"])
    assert ahead == (2, 2 * entry, 0)  # fetches count both files' bytes
    assert registry.fetch_ahead(["c", "a"]) == 0  # on the node already
    registry.read(registry.get("c"))
    registry.read(registry.get("c"))
    registry.read(registry.get("d"))
    snapshot = registry.node_snapshot()
    assert (snapshot["fetched_ahead_used"], snapshot["fetched_ahead_used_bytes"]) == (1, entry)
    assert (snapshot["downloads"], snapshot["hits"], snapshot["used_bytes"]) == (3, 2, 3 * entry)


def test_fetches_for_requests_here_never_wait_behind_fetches_ahead(s3, registries, tmp_path, monkeypatch):
    for name in "ab":
        make_adapter(tmp_path / "local" / name, r=4)
        s3.put_folder(tmp_path / "local" / name, f"adapters/{name}")
    registry = registries([s3.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 24), fetch_workers=1)
    for name in "ab":
        registry.register(name, s3.uri("adapters", name))
    arrived, keys, download_all = threading.Event(), {}, registry.store.download_all
    parts = registry.store.parts

    def held_back(files, key):  # a's bytes take until `arrived` is set
        if any("/a/" in obj.uri for obj, _ in files):
            keys["a"] = key
            assert arrived.wait(30)
        return download_all(files, key=key)

    monkeypatch.setattr(registry.store, "download_all", held_back)
    try:
        assert registry.fetch_ahead(["a"]) == 1  # takes the one worker for fetches ahead
        wait_for(lambda: "a" in keys, 30, 0.01, "a's download started")
        assert keys["a"] == s3.uri("adapters", "a") and not parts.is_waited_for(keys["a"])
        assert registry.fetch_ahead(["b"]) == 0  # a fetch ahead waits for the worker
        # b, for a request here, starts at once; a request here for a makes a's ranges go first
        assert registry.fetch_ahead(["b", "a"], urgent={"a", "b"}) == 1
        assert parts.is_waited_for(keys["a"]) and parts.is_waited_for(s3.uri("adapters", "b"))
        # b's fetch ends a moment after its files land on the node
        wait_for(lambda: registry.on_node("b") and not registry.is_fetching("b"), 30, 0.01,
                 "b on the node while the fetch ahead waits")
        assert registry.is_fetching("a") and not registry.on_node("a")
    finally:
        arrived.set()
    wait_for_fetches(registry)
    assert registry.on_node("a") and not registry.is_fetching("a")
    assert registry.node_snapshot()["downloads"] == 2  # a once, however many asked
    registry.fetch_ahead([], urgent=set())  # no request queued here any more
    assert not parts.is_waited_for(keys["a"])
