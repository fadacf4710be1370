"""The router's placement policy: affinity, spreading from a saturated holder, and the hint budget."""

import random

from routing.placement import MIN_HINT_ROOM, ReplicaLoad, can_hint, hint_room, place


def test_a_request_waiting_at_a_saturated_holder_names_its_spread_target():
    full = ReplicaLoad("h", ongoing=8, capacity=8, resident=frozenset({"a"}))
    idle = ReplicaLoad("f", ongoing=1, capacity=8, free_slots=2)
    rng = random.Random(0)
    early = place("a", [full, idle], waited_s=0.0, spread_after_s=0.2, rng=rng)
    assert (early.uid, early.must_wait, early.spread_to) == ("h", True, "f")
    late = place("a", [full, idle], waited_s=0.5, spread_after_s=0.2, rng=rng)
    assert (late.uid, late.outcome, late.spread_to) == ("f", "spread", None)
    both_full = place("a", [full, ReplicaLoad("g", 8, 8)], waited_s=0.0, spread_after_s=0.2, rng=rng)
    assert both_full.must_wait and both_full.spread_to is None


def test_a_waiting_request_keeps_its_replica_while_every_replica_is_full():
    """A cold request in front of equally full replicas drew a new one at random on every routing attempt (a new
    hint, and a withdrawn read, each time); it now keeps waiting where it waits, and leaves as soon as any
    replica has room."""
    full = [ReplicaLoad("a", 8, 8), ReplicaLoad("b", 8, 8)]
    rng = random.Random(0)
    drawn = {place("x", full, waited_s=0.0, spread_after_s=0.2, rng=rng).uid for _ in range(20)}
    assert drawn == {"a", "b"}  # without the request's own history: a coin flip per attempt
    assert {place("x", full, 0.0, 0.2, rng=rng, waiting_for="b").uid for _ in range(20)} == {"b"}
    freed = [ReplicaLoad("a", 7, 8), ReplicaLoad("b", 8, 8)]
    sent = place("x", freed, 0.0, 0.2, rng=rng, waiting_for="b")
    assert (sent.uid, sent.must_wait) == ("a", False)
    gone = place("x", full, 0.0, 0.2, rng=rng, waiting_for="c")  # its replica left: drawn afresh
    assert gone.uid in ("a", "b") and gone.must_wait
    holder = [ReplicaLoad("h", 8, 8, resident=frozenset({"x"})), ReplicaLoad("b", 8, 8)]
    stays = place("x", holder, 0.0, 0.2, rng=rng, waiting_for="b")
    assert (stays.uid, stays.must_wait, stays.spread_to) == ("b", True, None)


def test_hint_room_is_the_host_cache_less_the_busy_adapters_never_below_the_floor():
    assert hint_room(host_adapters=16, busy_adapters=0) == 16
    assert hint_room(host_adapters=16, busy_adapters=10) == 6
    assert hint_room(host_adapters=16, busy_adapters=20) == MIN_HINT_ROOM == 0


def test_the_hint_budget_counts_distinct_adapters():
    live = {"r1": "a", "r2": "b", "r3": "a"}  # request -> adapter of the live waiting hints at one replica
    assert not can_hint("c", live.values(), room=2)  # full: two adapters hinted
    assert can_hint("a", live.values(), room=2)  # already hinted there: costs no room
    assert can_hint("c", live.values(), room=3)
    assert can_hint("c", live.values(), room=None)  # a replica that reports no room: no limit
    assert not can_hint("c", [], room=0) and can_hint("a", ["a"], room=0)  # no room: only an adapter already hinted
    del live["r2"]  # b's request completed, was withdrawn or expired: room frees
    assert can_hint("c", live.values(), room=2)
    live["r4"] = "c"
    del live["r1"]  # a still has r3 on its way: a and c fill the room
    assert can_hint("c", live.values(), room=2) and not can_hint("d", live.values(), room=2)
