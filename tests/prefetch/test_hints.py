"""What the router tells a replica: hint counts per adapter, incoming spreads, where they come from, and how many."""

import random

from prefetch.hints import HintBook, in_order_batches
from prefetch.placement import MIN_HINT_ROOM, ReplicaLoad, can_hint, hint_room, place


def test_one_entry_per_waiting_request_consumed_by_arrivals():
    book = HintBook(ttl_s=10.0)
    book.add("a", 1.0)
    book.add("b", 2.0)
    book.add("a", 3.0)
    assert book.demand() == ["a", "a", "b"]  # the oldest waiting hint first, once per request
    assert book.arrived("a", 4.0) == 1.0  # the oldest hint: its lead time
    assert book.demand() == ["b", "a"]  # b's request (hinted at 2.0) is now due before a's (3.0)
    assert book.arrived("a", 4.0) == 3.0 and book.arrived("a", 4.0) is None and "a" not in book


def test_a_request_consumes_its_own_hint_and_a_hint_after_its_request_is_dropped():
    """The request can reach the engine before its hint (the two take different paths): without ids, the late hint
    waited for the adapter's next request, 10-30 s later on the H100 Serve claim, and kept it in the demand."""
    book = HintBook(ttl_s=30.0)
    assert book.add("a", 1.0, "r1") == book.add("a", 2.0, "r2") == "added"
    assert book.arrived("a", 3.0, "r2") == 2.0  # its own hint, not the oldest
    assert book.demand() == ["a"]
    assert book.arrived("a", 4.0, "r3") is None  # arrived first: its hint is on its way
    assert book.add("a", 4.02, "r3") == "late"  # dropped, not left for a later request
    assert book.demand() == ["a"] and book.arrived("a", 5.0, "r1") == 1.0 and "a" not in book
    book.withdraw("b", "r9")  # never hinted: nothing to drop
    assert book.add("b", 6.0, "r4") == book.add("b", 6.5, "r5") == "added"
    book.withdraw("b", "r4")  # the request that went elsewhere, not the newest
    assert book.arrived("b", 7.0, "r5") == 6.5
    assert book.arrived("c", 8.0, "r6") is None
    book.expire(40.0)  # an arrival whose hint never came is forgotten after ttl_s
    assert book.add("c", 40.0, "r6") == "added"


def test_a_request_hinted_twice_has_one_entry():
    """Serve's router can hint a request again after a full replica turned it away; a second entry would outlive
    the request's arrival (which consumes one) and keep its adapter in the demand until it expired."""
    book = HintBook(ttl_s=30.0)
    assert book.add("a", 1.0, "r1") == "added" and book.add("a", 1.5, "r1") == "duplicate"
    assert book.add("a", 1.6, None) == book.add("a", 1.7, None) == "added"  # without ids: one per hint
    assert book.demand() == ["a", "a", "a"]
    assert book.arrived("a", 2.0, "r1") == 1.0 and book.demand() == ["a", "a"]


def test_hints_without_ids_go_to_the_oldest_request():
    book = HintBook(ttl_s=30.0)
    book.add("a", 1.0)
    assert book.arrived("a", 2.0, "r1") == 1.0  # a request with an id still takes a hint sent without one
    assert book.arrived("a", 2.0) is None and book.add("a", 3.0)  # no id: no late match


def test_hints_and_incoming_expire():
    book = HintBook(ttl_s=10.0, incoming_ttl_s=2.0)
    book.add("a", 0.0)
    book.add("a", 9.0)
    book.add_incoming("x", 0.0)
    book.expire(5.0)
    assert book.demand() == ["a", "a"] and book.incoming() == frozenset()
    book.expire(15.0)
    assert book.demand() == ["a"]
    book.add_incoming("y", 15.0)
    assert book.incoming() == {"y"}
    book.arrived("y", 15.5)  # the spread came: it now counts as a queued request, not an announcement
    assert book.incoming() == frozenset()


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


def test_a_withdrawn_hint_leaves_the_demand():
    from prefetch.hints import HintBook

    book = HintBook(ttl_s=30)
    book.add("a", 1.0)
    book.add("b", 2.0)
    book.add("a", 3.0)
    book.withdraw("a")
    assert book.demand() == ["a", "b"]
    book.withdraw("a")
    book.withdraw("c")  # never hinted: nothing to drop
    assert book.demand() == ["b"] and "a" not in book


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


def test_a_poll_applies_hints_in_the_order_the_router_sent_them():
    """The engine applies a batch's waiting hints before its withdrawals; a request hinted, withdrawn and hinted
    again in one poll must keep its hint (applied as one batch, the second add was a duplicate and the withdrawal
    then dropped the hint)."""
    hints = [{"kind": "waiting", "request_id": "r1"}, {"kind": "waiting", "request_id": "r2"},
             {"kind": "withdrawn", "request_id": "r1"}, {"kind": "incoming", "request_id": "r3"},
             {"kind": "waiting", "request_id": "r1"}, {"kind": "withdrawn", "request_id": "r2"}]
    batches = in_order_batches(hints)
    assert batches == [hints[:4], hints[4:]]
    book = HintBook(ttl_s=30.0)
    for batch in batches:  # as Engine.hint applies each batch
        outcomes = [book.add("a", 0.0, h["request_id"]) for h in batch if h["kind"] == "waiting"]
        assert "duplicate" not in outcomes
        for h in batch:
            if h["kind"] == "withdrawn":
                book.withdraw("a", h["request_id"])
    assert book.demand() == ["a"] and book.arrived("a", 1.0, "r1") == 0.0  # r1's hint is there, r2's is not
    assert in_order_batches([]) == [] and in_order_batches(hints[:2]) == [hints[:2]]


def test_a_request_hinted_far_back_is_fetched_only_until_it_nears_the_front():
    book = HintBook(ttl_s=30.0)
    assert book.add("a", 0.0, "r1", near=False) == "added" and book.add("b", 1.0, "r2") == "added"
    assert book.demand() == ["b"] and book.ahead() == ["a"]  # "a" only to the node, "b" into every tier
    assert book.add("a", 2.0, "r1", near=False) == "duplicate"
    assert book.add("a", 3.0, "r1") == "upgraded"  # near the front now: it keeps its place (its first hint)
    assert book.demand() == ["a", "b"] and book.ahead() == []
    assert book.add("a", 4.0, "r1") == "duplicate"
    assert book.arrived("a", 5.0, "r1") == 0.0  # the lead counts from the first hint
    book.add("c", 6.0, "r3", near=False)
    book.withdraw("c", "r3")
    assert book.ahead() == [] and "c" not in book
