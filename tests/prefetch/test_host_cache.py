import threading

import pytest
import torch

from prefetch.host_cache import HostAdapter, HostCache


def reader(nbytes=400, fail=()):
    calls = []

    def read(adapter_id):
        calls.append(adapter_id)
        if adapter_id in fail:
            raise OSError(f"{adapter_id} vanished")
        return HostAdapter(adapter_id, torch.zeros(nbytes // 4), torch.zeros(1), 0.0)

    return read, calls


def test_lru_under_byte_budget():
    read, calls = reader()
    cache = HostCache(budget_bytes=1000, read_fn=read)
    for a in ["a", "b"]:
        cache.fetch(a).result()
        cache.collect(a)
    cache.fetch("a").result()  # hit: a becomes most recent
    cache.collect("a")
    cache.fetch("c").result()
    cache.collect("c")  # 1200 bytes > 1000: evict LRU, which is b
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.bytes_used == 800 and calls == ["a", "b", "c"]
    cache.check_invariants()


def test_concurrent_fetches_share_one_read():
    gate = threading.Event()
    calls = []

    def read(adapter_id):
        calls.append(adapter_id)
        gate.wait()
        return HostAdapter(adapter_id, torch.zeros(4), torch.zeros(1), 0.0)

    cache = HostCache(budget_bytes=1 << 20, read_fn=read)
    first, second = cache.fetch("a"), cache.fetch("a")
    gate.set()
    assert first is second and first.result().adapter_id == "a" and calls == ["a"]


def test_read_error_surfaces_on_collect_and_leaves_no_entry():
    read, _ = reader(fail={"bad"})
    cache = HostCache(budget_bytes=1 << 20, read_fn=read)
    cache.fetch("bad").exception()
    with pytest.raises(OSError, match="vanished"):
        cache.collect("bad")
    assert "bad" not in cache
    cache.check_invariants()


def test_discard_forgets_entry():
    read, _ = reader()
    cache = HostCache(budget_bytes=1 << 20, read_fn=read)
    cache.fetch("a").result()
    cache.collect("a")
    cache.discard("a")
    assert "a" not in cache and cache.bytes_used == 0
