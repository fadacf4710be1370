import random

import pytest

from prefetch.slot_pool import PageAllocator, SlotPool, SlotState


def table(pool):
    return [(s.adapter_id, s.state.value, s.pins, s.pages) for s in pool.slots]


def test_lifecycle_table_after_each_step():
    pool = SlotPool(num_pages=4, max_slots=2)
    assert table(pool) == [(None, "free", 0, ()), (None, "free", 0, ())]
    assert pool.begin_load("a", 3) == 0
    assert table(pool) == [("a", "loading", 0, (0, 1, 2)), (None, "free", 0, ())]
    assert not pool.can_begin_load(2) and pool.can_begin_load(1)
    pool.finish_load(0)
    pool.pin(0)
    assert table(pool) == [("a", "ready", 1, (0, 1, 2)), (None, "free", 0, ())]
    assert not pool.can_evict(0)
    pool.unpin(0)
    assert pool.evict(0) == ("a", True)
    assert pool.begin_load("b", 4) == 0
    assert table(pool) == [("b", "loading", 0, (0, 1, 2, 3)), (None, "free", 0, ())]
    assert not pool.can_begin_load(1), "no page is free, though a slot is"
    pool.finish_load(0)
    assert pool.evict(0) == ("b", False)  # loaded, never used: a wasted prefetch
    assert pool.free_page_count() == 4 and pool.free_count() == 2
    pool.check_invariants()


def test_slots_bound_residency_even_with_free_pages():
    pool = SlotPool(num_pages=8, max_slots=2)
    pool.begin_load("a", 1)
    pool.begin_load("b", 1)
    assert pool.free_page_count() == 6 and not pool.can_begin_load(1)


def test_pages_of_an_evicted_adapter_are_reused_anywhere():
    pool = SlotPool(num_pages=4)
    for adapter in "abcd":
        pool.finish_load(pool.begin_load(adapter, 1))
    pool.evict(pool.lookup("a"))
    pool.evict(pool.lookup("c"))
    slot = pool.begin_load("big", 2)  # two pages that are not adjacent
    assert pool.slots[slot].pages == (0, 2)
    pool.check_invariants()


def test_pinned_slot_is_never_overwritten():
    pool = SlotPool(1)
    pool.finish_load(pool.begin_load("a", 1))
    pool.pin(0)
    with pytest.raises(AssertionError):
        pool.begin_load("b", 1)
    with pytest.raises(AssertionError):
        pool.evict(0)
    assert table(pool) == [("a", "ready", 1, (0,))]


def test_failed_load_frees_slot_and_pages_and_double_residency_is_refused():
    pool = SlotPool(num_pages=2)
    pool.begin_load("a", 1)
    with pytest.raises(AssertionError):
        pool.begin_load("a", 1)
    pool.fail_load(0)
    assert pool.state_of("a") is None and pool.free_count() == 2 and pool.free_page_count() == 2
    pool.check_invariants()


def test_invariants_catch_corruption():
    pool = SlotPool(2)
    pool.begin_load("a", 1)
    pool.adapter_to_slot["a"] = 1
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = SlotPool(2)
    pool.begin_load("a", 1)
    pool.pages.free([0])  # a page both owned and free
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_unpin_of_unpinned_slot_is_a_bug():
    pool = SlotPool(1)
    pool.begin_load("a", 1)
    with pytest.raises(AssertionError):
        pool.unpin(0)
    assert pool.slots[0].state is SlotState.LOADING


def test_random_churn_keeps_pages_and_slots_consistent():
    """Hundreds of adapters of mixed page counts: every page owned once or free, after every action."""
    rng = random.Random(0)
    pool = SlotPool(num_pages=64, max_slots=40)
    for step in range(3000):
        adapter = f"a{rng.randrange(300)}"
        slot = pool.lookup(adapter)
        if slot is None:
            need = rng.choice((1, 2, 4, 16))
            if pool.can_begin_load(need):
                pool.begin_load(adapter, need)
        elif pool.slots[slot].state is SlotState.LOADING:
            (pool.finish_load if rng.random() < 0.9 else pool.fail_load)(slot)
        elif pool.slots[slot].pins and rng.random() < 0.6:
            pool.unpin(slot)
        elif rng.random() < 0.5:
            pool.pin(slot)
        elif pool.can_evict(slot):
            pool.evict(slot)
        pool.check_invariants()
    assert sum(len(s.pages) for s in pool.slots) + pool.free_page_count() == 64


def test_allocator_refuses_more_than_it_has():
    pages = PageAllocator(3)
    assert pages.alloc(2) == (0, 1) and not pages.can_alloc(2)
    with pytest.raises(AssertionError):
        pages.alloc(2)
