from prefetch.policy import SlotView, plan
from prefetch.slot_pool import SlotState

F, L, R = SlotState.FREE, SlotState.LOADING, SlotState.READY


def views(*specs):
    """specs: (adapter_id, state, pinned, last_used) per slot."""
    return [SlotView(i, a, s, p, t) for i, (a, s, p, t) in enumerate(specs)]


def test_free_slots_first_then_lru_idle():
    slots = views((None, F, False, 0), ("x", R, False, 5), ("y", R, False, 3))
    assert plan(slots, ["a", "b"], max_loads=4).loads == (("a", 0), ("b", 2))


def test_prefers_evicting_adapters_nobody_demands():
    slots = views(("x", R, False, 1), ("y", R, False, 9))
    # x is older, but a queued request needs it: evict y instead.
    assert plan(slots, ["a", "x"], max_loads=4).loads == (("a", 1),)


def test_pinned_and_loading_slots_are_never_victims():
    slots = views(("x", R, True, 0), ("y", L, False, 0))
    assert plan(slots, ["a"], max_loads=4).loads == ()


def test_lower_priority_demand_yields_to_higher():
    slots = views(("x", R, False, 0), ("y", R, False, 0))
    # demand order: a (top), x, y (lowest). Only one slot can go, and only to the higher one.
    assert plan(slots, ["a", "x", "y"], max_loads=4).loads == (("a", 1),)


def test_lookahead_is_bounded_by_slots_and_max_loads():
    slots = views((None, F, False, 0), (None, F, False, 0))
    assert plan(slots, ["a", "b", "c"], max_loads=4).loads == (("a", 0), ("b", 1))
    assert plan(slots, ["a", "b"], max_loads=1).loads == (("a", 0),)
    assert not plan(slots, ["a"], max_loads=0)


def test_resident_or_loading_demand_needs_nothing():
    slots = views(("a", R, False, 0), ("b", L, False, 0))
    assert plan(slots, ["a", "b", "a"], max_loads=4).loads == ()
