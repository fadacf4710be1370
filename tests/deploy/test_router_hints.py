"""AdapterAffinityRouter with hints off (the A0 arm) places requests as with hints on and sends no hint; with
hints on, it keeps within each replica's hint room.

The router runs without Serve here: fake replicas and pending requests, a view set by hand (dicts the tests
change, which the router reads as ReplicaStats), and a fake router actor that records push_hint calls as tuples.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, namedtuple
from types import SimpleNamespace

import pytest

from deploy.app import replica_options
from deploy.args import AppArgs
from deploy.router import AdapterAffinityRouter
from routing.wire import Hint, HintKind, ReplicaStats


ReplicaId = namedtuple("ReplicaId", "unique_id")  # hashable, as the queue-length cache needs


class FakeActor:
    def __init__(self):
        self.hints = []  # (replica, adapter, request id) for a waiting hint, with the kind's value after for others
        self.push_hint = SimpleNamespace(remote=self._record)

    def _record(self, uid: str, hint: Hint) -> None:
        kind = () if hint.kind is HintKind.WAITING else (hint.kind.value,)
        self.hints.append((uid, hint.adapter_id, hint.request_id, *kind))


class LiveView(dict):
    """The router's view over dicts that a test changes: each read is the replica's stats as they are now."""

    def get(self, uid, default=None):
        return ReplicaStats.from_dict(self[uid]) if uid in self else default


def replica(uid: str, capacity: int = 2):
    return SimpleNamespace(replica_id=ReplicaId(uid), routing_stats={}, max_ongoing_requests=capacity)


def pending(adapter_id: str, rid: str, waited_s: float = 0.0):
    return SimpleNamespace(routing_context=SimpleNamespace(should_backoff=False), created_at=time.time() - waited_s,
                           future=SimpleNamespace(done=lambda: False),
                           metadata=SimpleNamespace(multiplexed_model_id=adapter_id, internal_request_id=rid))


def router(hints: bool, view: dict) -> tuple[AdapterAffinityRouter, FakeActor]:
    r = AdapterAffinityRouter.__new__(AdapterAffinityRouter)  # no Serve: only what choose_replicas reads
    r.initialize_state(spread_after_s=0.2, hints=hints)
    r._ensure_refresh = lambda: None
    r._replica_queue_len_cache = {}
    r._outcomes = SimpleNamespace(inc=lambda tags: None)
    r._actor, r._view, r._view_at = FakeActor(), view if isinstance(view, LiveView) else LiveView(view), time.monotonic()
    return r, r._actor


# "a" holds pirate and is full; "b" is free: a fresh request for pirate waits at "a" (hint) and may spread
# to "b" (incoming hint); after spread_after_s it goes to "b". Other adapters go cold to "b".
VIEW = {"a": {"ongoing": 2, "resident": ["pirate"], "free_slots": 0}, "b": {"ongoing": 0, "free_slots": 2}}


def choose(r, request) -> str:
    [[chosen]] = asyncio.run(r.choose_replicas([replica("a"), replica("b")], request))
    return chosen.replica_id.unique_id


@pytest.mark.parametrize("hints", [True, False])
def test_placement_is_the_same_and_only_hints_on_sends_hints(hints):
    r, actor = router(hints, VIEW)
    assert choose(r, pending("pirate", "r1")) == "a"  # waits at the holder
    assert choose(r, pending("pirate", "r2", waited_s=1.0)) == "b"  # spread after waiting
    assert choose(r, pending("chef", "r3")) == "b"  # cold, to the free replica
    if hints:
        assert sorted(actor.hints) == [("a", "pirate", "r1"), ("b", "pirate", "r1", "incoming")]
    else:
        assert actor.hints == [] and all(w.hinted_to is None and w.spread_to is None for w in r._requests.values())


def test_app_passes_hints_to_the_router():
    for hints in (True, False):
        config = replica_options(AppArgs(build_demo=False, hints=hints))["request_router_config"]
        assert config.request_router_kwargs == {"spread_after_s": 0.2, "hints": hints, "hint_depth": 48}


def test_a_request_routed_again_is_hinted_once_per_replica_until_it_is_accepted():
    """Ray 2.60 calls on_request_completed also when a full replica turns an attempt away (it cancels the attempt):
    the request waits again and must not be hinted again (a CPU trace of that bug: 96 hints for 75 requests)."""
    r, actor = router(True, VIEW)
    for _ in range(3):  # turned away by the full replica, it waits there again
        request = pending("pirate", "r1")
        assert choose(r, request) == "a"
        r.on_request_completed(ReplicaId("a"), "r1")  # the rejected attempt's callback
    assert sorted(actor.hints) == [("a", "pirate", "r1"), ("b", "pirate", "r1", "incoming")]
    r.on_request_routed(request, ReplicaId("a"), None)  # accepted: it has left the router
    assert r._requests == {}


def test_a_request_turned_away_then_sent_elsewhere_withdraws_its_hint():
    r, actor = router(True, VIEW)
    assert choose(r, pending("pirate", "r1")) == "a"
    r.on_request_completed(ReplicaId("a"), "r1")  # turned away by "a"
    assert choose(r, pending("pirate", "r1", waited_s=1.0)) == "b"  # spreads
    assert ("a", "pirate", "r1", "withdrawn") in actor.hints


def test_a_hinted_request_that_goes_elsewhere_withdraws_its_hint():
    r, actor = router(True, VIEW)
    assert choose(r, pending("pirate", "r1")) == "a"  # waits at the holder: hinted there
    assert choose(r, pending("pirate", "r1", waited_s=1.0)) == "b"  # spreads after all
    assert ("a", "pirate", "r1", "withdrawn") in actor.hints and r._requests["r1"].hinted_to is None


# Both replicas are full and "a" holds every adapter: each request waits at "a", within its hint room of 2.
FULL = {"a": {"ongoing": 2, "resident": ["pirate", "chef", "poet"], "hint_room": 2}, "b": {"ongoing": 2}}


def waiting_hints(actor) -> list[tuple]:
    return [h for h in actor.hints if len(h) == 3]


def test_hints_stay_within_the_replicas_hint_room_and_resume_when_it_frees():
    r, actor = router(True, FULL)
    outcomes = Counter()
    r._outcomes = SimpleNamespace(inc=lambda tags: outcomes.update([tags["outcome"]]))
    for adapter_id, rid in [("pirate", "r1"), ("chef", "r2"), ("poet", "r3"), ("pirate", "r4")]:
        assert choose(r, pending(adapter_id, rid)) == "a"
    # poet would be a third adapter: held back; pirate again costs no room.
    assert waiting_hints(actor) == [("a", "pirate", "r1"), ("a", "chef", "r2"), ("a", "pirate", "r4")]
    choose(r, pending("poet", "r3"))  # routed again after a backoff: still no room
    assert outcomes["hint"] == 3 and outcomes["hint_deferred"] == 1  # counted once per request held back
    r.on_request_completed(ReplicaId("a"), "r1")  # pirate still has r4 on its way: no room yet
    choose(r, pending("poet", "r3"))
    assert ("a", "poet", "r3") not in actor.hints
    r.on_request_completed(ReplicaId("a"), "r2")  # chef's request is gone: poet takes its room
    choose(r, pending("poet", "r3"))
    assert waiting_hints(actor)[-1] == ("a", "poet", "r3") and outcomes["hint"] == 4


def test_a_request_sent_on_or_withdrawn_frees_its_room():
    view = {"a": {**FULL["a"], "hint_room": 1}, "b": dict(FULL["b"])}
    r, actor = router(True, view)
    assert choose(r, pending("pirate", "r1")) == "a"
    assert choose(r, pending("chef", "r2")) == "a"  # held back: pirate fills the room
    view["a"]["ongoing"] = 1  # "a" takes r1: it no longer waits on the budget (it is busy there now)
    assert choose(r, pending("pirate", "r1")) == "a"
    view["a"]["ongoing"] = 2
    assert choose(r, pending("chef", "r2")) == "a"
    assert waiting_hints(actor) == [("a", "pirate", "r1"), ("a", "chef", "r2")]
    view["b"]["ongoing"] = 0  # r2 spreads to "b" after waiting: its hint at "a" is withdrawn, and room frees
    assert choose(r, pending("chef", "r2", waited_s=1.0)) == "b"
    assert ("a", "chef", "r2", "withdrawn") in actor.hints
    view["b"]["ongoing"] = 2
    assert choose(r, pending("poet", "r3")) == "a" and waiting_hints(actor)[-1] == ("a", "poet", "r3")


def test_a_replica_that_reports_no_hint_room_gets_every_hint():
    view = {**FULL, "a": {k: v for k, v in FULL["a"].items() if k != "hint_room"}}
    r, actor = router(True, view)
    for i, adapter_id in enumerate(["pirate", "chef", "poet"]):
        choose(r, pending(adapter_id, f"r{i}"))
    assert len(waiting_hints(actor)) == 3


def test_requests_behind_the_front_are_hinted_in_order_and_never_overtake_an_older_one():
    """Serve routes two pending requests per replica at a time; the router routes hint_depth more, which it only
    places and hints: a replica that frees a place takes the oldest request, never one from behind the front."""
    view = {"a": {"ongoing": 2, "hint_room": 16}, "b": {"ongoing": 2, "hint_room": 16}}  # both full: all wait
    r, actor = router(True, view)
    requests = [pending(f"adapter{i}", f"r{i}", waited_s=10 - i) for i in range(7)]  # r0 oldest
    chosen = [asyncio.run(r.choose_replicas([replica("a"), replica("b")], request)) for request in requests]
    assert all(len(c) == 1 for c in chosen[:4]) and chosen[4:] == [[], [], []]  # front: 2 x 2 replicas
    # every one hinted, in order: the front "waiting", those behind "ahead" (fetched to the node only)
    assert [h[2] for h in waiting_hints(actor)] == [f"r{i}" for i in range(4)]
    assert [h[2] for h in actor.hints if h[3:] == ("ahead",)] == ["r4", "r5", "r6"]
    view["b"]["ongoing"] = 0  # "b" frees: requests behind the front still wait
    assert asyncio.run(r.choose_replicas([replica("a"), replica("b")], requests[6])) == []
    for request in requests[:3]:  # the three oldest are accepted: r6 reaches the front and may go
        r.on_request_routed(request, ReplicaId("b"), None)
    assert choose(r, requests[6]) == "b"


def five_waiting(r) -> list:
    """Five requests for pirate at FULL's replicas, oldest first: four at the front (2 x 2 replicas), one behind."""
    requests = [pending("pirate", f"r{i}", waited_s=10 - i) for i in range(5)]
    for request in requests[:4]:
        choose(r, request)
    assert asyncio.run(r.choose_replicas([replica("a"), replica("b")], requests[4])) == []
    return requests


def test_a_request_hinted_ahead_is_hinted_waiting_once_near_the_front():
    r, actor = router(True, FULL)
    requests = five_waiting(r)
    assert actor.hints[-1] == ("a", "pirate", "r4", "ahead")
    r.on_request_routed(requests[0], ReplicaId("a"), None)  # r4 nears the front, still waiting at "a"
    assert choose(r, requests[4]) == "a" and actor.hints[-1] == ("a", "pirate", "r4")
    choose(r, requests[4])  # turned away and routed again: no third hint
    assert [h for h in actor.hints if h[2] == "r4"] == [("a", "pirate", "r4", "ahead"), ("a", "pirate", "r4")]


def test_a_cancelled_request_in_front_moves_those_behind_up():
    r, _ = router(True, FULL)
    requests = five_waiting(r)
    requests[0].future = SimpleNamespace(done=lambda: True)  # cancelled by its client
    assert choose(r, requests[4]) == "a"


def test_a_request_turned_away_holds_no_place_in_front_until_it_is_routed_again():
    """Serve gives a request a new future when a full replica turns it away and queues it again, perhaps with
    no routing task while every task holds a request behind it: those must not wait for it (nor it for them)."""
    r, _ = router(True, FULL)
    requests = five_waiting(r)
    for request in requests[:4]:  # all four sent to a replica: their futures are done
        request.future = SimpleNamespace(done=lambda: True)
    assert choose(r, requests[4]) == "a"  # r4 is at the front now
    for request in requests[:4]:  # all four turned away: queued again with new futures, not yet routed
        request.future = SimpleNamespace(done=lambda: False)
    assert choose(r, requests[4]) == "a"  # still at the front: nothing in front of it is being routed
    assert asyncio.run(r.choose_replicas([replica("a"), replica("b")], requests[0])) != []  # routed again: in front


def test_without_hints_the_router_routes_as_many_requests_as_serve_does():
    r, _ = router(False, FULL)
    assert r.hint_depth == 0
    for i in range(8):  # no request is held behind the front: each is placed as Serve's routing tasks ask
        assert choose(r, pending("pirate", f"r{i}", waited_s=10 - i)) == "a"


def test_a_request_behind_the_front_keeps_its_replica_unless_another_holds_its_adapter():
    view = {"a": {"ongoing": 2, "hint_room": 16}, "b": {"ongoing": 2, "hint_room": 16}}
    r, actor = router(True, view)
    requests = [pending(f"adapter{i}", f"r{i}", waited_s=10 - i) for i in range(5)]
    for request in requests:
        asyncio.run(r.choose_replicas([replica("a"), replica("b")], request))
    [(first, _, _, _)] = [h for h in actor.hints if h[2] == "r4"]
    other = "b" if first == "a" else "a"
    view[first]["ongoing"], view[other]["ongoing"] = 2, 0  # the other frees: r4 still waits where it was hinted
    for _ in range(3):
        assert asyncio.run(r.choose_replicas([replica("a"), replica("b")], requests[4])) == []
    assert [h for h in actor.hints if h[2] == "r4"] == [(first, "adapter4", "r4", "ahead")]  # no move, no new hint
    view[other]["resident"] = ["adapter4"]  # its adapter is now resident on the other: the hint moves there
    asyncio.run(r.choose_replicas([replica("a"), replica("b")], requests[4]))
    assert (first, "adapter4", "r4", "withdrawn") in actor.hints and (other, "adapter4", "r4", "ahead") in actor.hints
