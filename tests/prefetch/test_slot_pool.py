import pytest

from prefetch.slot_pool import SlotPool, SlotState


def table(pool):
    return [(s.adapter_id, s.state.value, s.pins) for s in pool.slots]


def test_lifecycle_table_after_each_step():
    pool = SlotPool(2)
    assert table(pool) == [(None, "free", 0), (None, "free", 0)]
    assert pool.begin_load(0, "a") == (None, False)
    assert table(pool) == [("a", "loading", 0), (None, "free", 0)]
    pool.finish_load(0)
    pool.pin(0)
    assert table(pool) == [("a", "ready", 1), (None, "free", 0)]
    assert not pool.can_begin_load(0) and not pool.can_evict(0)
    pool.unpin(0)
    assert pool.begin_load(0, "b") == ("a", True)
    assert table(pool) == [("b", "loading", 0), (None, "free", 0)]
    pool.finish_load(0)
    assert pool.evict(0) == ("b", False)  # loaded, never used: a wasted prefetch
    assert table(pool) == [(None, "free", 0), (None, "free", 0)]
    pool.check_invariants()


def test_pinned_slot_is_never_overwritten():
    pool = SlotPool(1)
    pool.begin_load(0, "a")
    pool.finish_load(0)
    pool.pin(0)
    with pytest.raises(AssertionError):
        pool.begin_load(0, "b")
    with pytest.raises(AssertionError):
        pool.evict(0)
    assert table(pool) == [("a", "ready", 1)]


def test_failed_load_frees_slot_and_double_residency_is_refused():
    pool = SlotPool(2)
    pool.begin_load(0, "a")
    with pytest.raises(AssertionError):
        pool.begin_load(1, "a")
    pool.fail_load(0)
    assert pool.state_of("a") is None and pool.free_count() == 2
    pool.check_invariants()


def test_invariants_catch_corruption():
    pool = SlotPool(2)
    pool.begin_load(0, "a")
    pool.adapter_to_slot["a"] = 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_unpin_of_unpinned_slot_is_a_bug():
    pool = SlotPool(1)
    pool.begin_load(0, "a")
    with pytest.raises(AssertionError):
        pool.unpin(0)
    assert pool.slots[0].state is SlotState.LOADING
