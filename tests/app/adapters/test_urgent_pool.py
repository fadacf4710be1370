import threading

import pytest

from app.adapters.urgent_pool import UrgentFirstPool


def _blocked_pool():
    """A one-thread pool whose thread is busy until the returned event is set."""
    pool, release, started = UrgentFirstPool(1, "test-pool"), threading.Event(), threading.Event()
    pool.submit(lambda: False, lambda: started.set() or release.wait(5))
    assert started.wait(5)
    return pool, release


def test_urgent_work_goes_first_and_the_rest_in_order():
    pool, release = _blocked_pool()
    done = []
    futures = [pool.submit(lambda urgent=urgent: urgent, done.append, name)
               for name, urgent in (("ahead 1", False), ("ahead 2", False), ("waited for", True), ("ahead 3", False))]
    release.set()
    for future in futures:
        future.result(5)
    assert done == ["waited for", "ahead 1", "ahead 2", "ahead 3"]
    pool.shutdown()


def test_queued_work_moves_ahead_once_a_request_waits_for_it():
    pool, release = _blocked_pool()
    done, waited_for = [], set()
    futures = [pool.submit(lambda name=name: name in waited_for, done.append, name) for name in ("a", "b", "c")]
    waited_for.add("c")  # after it was queued
    release.set()
    for future in futures:
        future.result(5)
    assert done == ["c", "a", "b"]
    pool.shutdown()


def test_errors_reach_the_caller_and_shutdown_cancels_what_is_queued():
    pool, release = _blocked_pool()
    failing = pool.submit(lambda: True, lambda: 1 / 0)
    queued = pool.submit(lambda: False, lambda: None)
    pool.shutdown()
    release.set()
    assert queued.cancelled() and failing.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: True, lambda: None)
    pool = UrgentFirstPool(1, "test-pool")
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: True, lambda: 1 / 0).result(5)
    pool.shutdown()
