import threading

import pytest
import torch

from prefetch.arena import HostArena
from prefetch.host_cache import HostCache

PAGE = 25  # float32 elements per page: 100 bytes


def make_cache(num_pages=10, pages=None, fail=(), gate=None):
    """A cache whose reads fill each page with the adapter's number; adapters need pages[a] pages (default 2)."""
    calls = []

    def read(adapter_id, views):
        calls.append(adapter_id)
        if gate is not None:
            gate.wait()
        if adapter_id in fail:
            raise OSError(f"{adapter_id} vanished")
        for view in views:
            view.fill_(float(ord(adapter_id[0])))
        return torch.ones(1), 4

    arena = HostArena(num_pages, PAGE, torch.float32, pin=False)
    cache = HostCache(arena, read, lambda a: (pages or {}).get(a, 2))
    return cache, calls


def load(cache, adapter_id):
    cache.fetch(adapter_id).result()
    return cache.collect(adapter_id)


def test_lru_within_the_arena():
    cache, calls = make_cache(num_pages=5)  # room for two 2-page adapters
    load(cache, "a")
    load(cache, "b")
    load(cache, "a")  # hit: a becomes most recent
    assert load(cache, "c").pages == (2, 3)  # b was least recently used: its pages go first
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.bytes_used == 4 * 100 and calls == ["a", "b", "c"]
    assert all(torch.all(v == ord("c")) for v in cache.collect("c").views)
    cache.check_invariants()


def test_concurrent_fetches_share_one_read():
    gate = threading.Event()
    cache, calls = make_cache(gate=gate)
    first, second = cache.fetch("a"), cache.fetch("a")
    gate.set()
    assert first is second and first.result().adapter_id == "a" and calls == ["a"]


def test_read_error_surfaces_on_collect_and_frees_its_pages():
    cache, _ = make_cache(fail={"bad"})
    cache.fetch("bad").exception()
    with pytest.raises(OSError, match="vanished"):
        cache.collect("bad")
    assert "bad" not in cache and cache.bytes_used == 0
    cache.check_invariants()


def test_discard_forgets_entry():
    cache, _ = make_cache()
    load(cache, "a")
    cache.discard("a")
    assert "a" not in cache and cache.bytes_used == 0
    cache.check_invariants()


def test_held_entries_are_never_evicted_and_reads_wait_for_room():
    cache, _ = make_cache(num_pages=4)
    load(cache, "a")
    load(cache, "b")
    cache.hold("a")
    cache.hold("b")  # both under a device copy
    future = cache.fetch("c")
    assert cache.is_deferred("c") and not future.done()
    assert cache.fetch("d", may_defer=False) is None, "warming reads never queue"
    cache.check_invariants()
    cache.release("a")
    cache.start_deferred()
    assert not cache.is_deferred("c") and future.result().pages == (0, 1)
    assert "a" not in cache and "b" in cache
    cache.collect("c")
    cache.check_invariants()


def test_discard_of_a_held_entry_frees_its_pages_on_release():
    cache, _ = make_cache(num_pages=4)
    load(cache, "a")
    cache.hold("a")
    cache.discard("a")
    assert "a" not in cache and cache.bytes_used == 200
    cache.check_invariants()
    cache.release("a")
    assert cache.bytes_used == 0
    cache.check_invariants()


def test_discarded_read_in_flight_keeps_its_pages_until_the_worker_is_done():
    gate = threading.Event()
    cache, _ = make_cache(gate=gate)
    future = cache.fetch("a")
    cache.discard("a")
    cache.absorb_finished()
    assert cache.bytes_used == 200, "the worker may still write these pages"
    gate.set()
    future.exception()
    cache.absorb_finished()
    assert cache.bytes_used == 0
    cache.check_invariants()


def test_budget_is_exact_pages_whatever_the_adapter_sizes():
    """Bytes accounted == bytes of the arena: mixed sizes never round up, and the arena is all there is."""
    cache, _ = make_cache(num_pages=10, pages={"a": 1, "b": 3, "c": 5, "d": 2})
    for adapter in "abcd":
        load(cache, adapter)
        assert cache.bytes_used <= cache.budget_bytes == cache.arena.nbytes == 10 * 100
        assert cache.bytes_used == sum(e.nbytes for e in cache._entries.values())
    assert sum(cache.collect(a).nbytes for a in "bcd") == 1000  # a went to make room for d


def test_a_read_keeps_the_entries_it_is_told_to():
    cache, _ = make_cache(num_pages=5)  # room for two 2-page adapters
    load(cache, "a")
    load(cache, "b")
    assert cache.fetch("c", may_defer=False, keep=frozenset({"a", "b"})) is None, "it would evict a kept entry"
    assert "a" in cache and "b" in cache
    cache.fetch("c", may_defer=False, keep=frozenset({"b"})).result()
    cache.collect("c")
    assert "a" not in cache and "b" in cache and "c" in cache
    cache.check_invariants()
