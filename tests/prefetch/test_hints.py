"""What a replica holds of the router's hints: one entry per request, incoming spreads, and requests hinted far back."""

from prefetch.hints import HintBook


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


def test_a_withdrawn_hint_leaves_the_demand():
    book = HintBook(ttl_s=30)
    book.add("a", 1.0)
    book.add("b", 2.0)
    book.add("a", 3.0)
    book.withdraw("a")
    assert book.demand() == ["a", "b"]
    book.withdraw("a")
    book.withdraw("c")  # never hinted: nothing to drop
    assert book.demand() == ["b"] and "a" not in book


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
