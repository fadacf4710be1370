from prefetch.policy import PoolView, SlotView, plan
from prefetch.slot_pool import SlotState

L, R = SlotState.LOADING, SlotState.READY


def pool(*specs, free_pages=0, free_slots=0):
    """specs: (adapter_id, state, pinned, last_used[, pages]) per occupied slot, slots numbered from 0."""
    views = tuple(SlotView(i, *spec) for i, spec in enumerate(specs))
    pages = free_pages + sum(v.pages for v in views)
    return PoolView(free_pages, free_slots, views, total_pages=pages, total_slots=len(views) + free_slots)


ONE = {a: 1 for a in "abcdxyz"}


def test_free_room_first_then_lru_idle():
    view = pool(("x", R, False, 5), ("y", R, False, 3), free_pages=1, free_slots=1)
    assert plan(view, ["a", "b"], ONE, max_loads=4).loads == (("a", ()), ("b", (1,)))


def test_prefers_evicting_adapters_nobody_demands():
    view = pool(("x", R, False, 1), ("y", R, False, 9))
    # x is older, but a queued request needs it: evict y instead.
    assert plan(view, ["a", "x"], ONE, max_loads=4).loads == (("a", (1,)),)


def test_pinned_and_loading_slots_are_never_victims():
    view = pool(("x", R, True, 0), ("y", L, False, 0))
    assert plan(view, ["a"], ONE, max_loads=4).loads == ()


def test_lower_priority_demand_yields_to_higher():
    view = pool(("x", R, False, 0), ("y", R, False, 0))
    # demand order: a (top), x, y (lowest). Only one slot can go, and only to the higher one.
    assert plan(view, ["a", "x", "y"], ONE, max_loads=4).loads == (("a", (1,)),)


def test_lookahead_is_bounded_by_the_pool_and_max_loads():
    view = pool(free_pages=2, free_slots=2)
    assert plan(view, ["a", "b", "c"], ONE, max_loads=4).loads == (("a", ()), ("b", ()))
    assert plan(view, ["a", "b"], ONE, max_loads=1).loads == (("a", ()),)
    assert not plan(view, ["a"], ONE, max_loads=0)


def test_resident_or_loading_demand_needs_nothing():
    view = pool(("a", R, False, 0), ("b", L, False, 0))
    assert plan(view, ["a", "b", "a"], ONE, max_loads=4).loads == ()


def test_a_large_rank_evicts_as_many_small_adapters_as_it_needs():
    view = pool(("x", R, False, 1), ("y", R, False, 2), ("z", R, False, 3), free_pages=1, free_slots=1)
    assert plan(view, ["a"], {"a": 3}, max_loads=1).loads == (("a", (0, 1)),)  # 1 free + x + y
    assert plan(view, ["a"], {"a": 5}, max_loads=1).loads == ()  # more than the pool holds


def test_a_slot_is_needed_as_well_as_pages():
    view = pool(("x", R, False, 1), free_pages=3, free_slots=0)
    assert plan(view, ["a"], {"a": 1, "x": 1}, max_loads=1).loads == (("a", (0,)),)


def test_a_big_adapter_that_cannot_fit_does_not_let_smaller_ones_pass():
    view = pool(("x", R, True, 1), free_pages=1, free_slots=3)
    assert plan(view, ["a", "b"], {"a": 2, "b": 1}, max_loads=2).loads == ()


def test_adapter_with_several_router_requests_is_not_evicted_for_a_one_off():
    # y is resident and idle here, but three requests for it wait in the router (three hints).
    view = pool(("x", R, True, 1), ("y", R, False, 2))
    demand = ["a", "y", "y", "y"]
    assert plan(view, demand, ONE, max_loads=1).loads == ()
    # Two requests for a make it no one-off: it may take y's place (it comes first in the queue).
    assert plan(view, ["a", "a", "y", "y", "y"], ONE, max_loads=1).loads == (("a", (1,)),)


def test_incoming_adapter_is_not_evicted_for_a_one_off():
    view = pool(("x", R, False, 1), ("y", R, False, 2))
    # x is least recently used, but a request waiting at another replica is about to bring it here.
    assert plan(view, ["a"], ONE, max_loads=1, incoming=frozenset({"x"})).loads == (("a", (1,)),)
    assert plan(view, ["a"], ONE, max_loads=1, incoming=frozenset({"x", "y"})).loads == ()
    assert plan(view, ["a", "a"], ONE, max_loads=1, incoming=frozenset({"x", "y"})).loads == (("a", (0,)),)
