"""The pool that fetches downloads' parts: parts of an adapter that a request waits for (a read under way, or a
request queued at the replica) go first, queued ones move ahead once a request comes to wait, the rest in order."""

import threading

import pytest

from app.adapters.part_pool import PartPool


def _blocked_pool():
    """A one-thread pool whose thread is busy until the returned event is set."""
    pool, release, started = PartPool(1, "test-pool"), threading.Event(), threading.Event()
    pool.submit("busy", lambda: started.set() or release.wait(5))
    assert started.wait(5)
    return pool, release


def test_parts_of_a_read_adapter_go_first_and_the_rest_in_order():
    pool, release = _blocked_pool()
    done = []
    with pool.waited_for("waited"):
        assert pool.is_waited_for("waited")
        futures = [pool.submit(key, done.append, name) for name, key in
                   (("ahead 1", "a"), ("ahead 2", "b"), ("waited for", "waited"), ("ahead 3", "c"))]
        release.set()
        for future in futures:
            future.result(5)
    assert done == ["waited for", "ahead 1", "ahead 2", "ahead 3"]
    assert not pool.is_waited_for("waited")
    pool.shutdown()


def test_queued_parts_move_ahead_once_a_request_queued_here_waits_for_them():
    pool, release = _blocked_pool()
    done = []
    futures = [pool.submit(key, done.append, key) for key in ("a", "b", "c")]
    pool.set_queued({"c"})  # after its parts were queued
    release.set()
    for future in futures:
        future.result(5)
    assert done == ["c", "a", "b"]
    pool.set_queued(())  # replaces the last ones named
    assert not pool.is_waited_for("c")
    pool.shutdown()


def test_errors_reach_the_caller_and_shutdown_cancels_what_is_queued():
    pool, release = _blocked_pool()
    failing = pool.submit("a", lambda: 1 / 0)
    queued = pool.submit("b", lambda: None)
    pool.shutdown()
    release.set()
    assert queued.cancelled() and failing.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("a", lambda: None)
    pool = PartPool(1, "test-pool")
    with pytest.raises(ZeroDivisionError):
        pool.submit("a", lambda: 1 / 0).result(5)
    pool.shutdown()
