"""AdapterAffinityRouter with hints off (the A0 arm) places requests as with hints on and sends no hint.

The router runs without Serve here: fake replicas and pending requests, a view set by hand, and a fake
router actor that records push_hint calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest

from deploy.app import replica_options
from deploy.args import AppArgs
from deploy.router import AdapterAffinityRouter


ReplicaId = namedtuple("ReplicaId", "unique_id")  # hashable, as the queue-length cache needs


class FakeActor:
    def __init__(self):
        self.hints = []
        self.push_hint = SimpleNamespace(remote=lambda *args: self.hints.append(args))


def replica(uid: str, capacity: int = 2):
    return SimpleNamespace(replica_id=ReplicaId(uid), routing_stats={}, max_ongoing_requests=capacity)


def pending(adapter_id: str, rid: str, waited_s: float = 0.0):
    return SimpleNamespace(routing_context=SimpleNamespace(should_backoff=False), created_at=time.time() - waited_s,
                           metadata=SimpleNamespace(multiplexed_model_id=adapter_id, internal_request_id=rid))


def router(hints: bool, view: dict) -> tuple[AdapterAffinityRouter, FakeActor]:
    r = AdapterAffinityRouter.__new__(AdapterAffinityRouter)  # no Serve: only what choose_replicas reads
    r.initialize_state(spread_after_s=0.2, hints=hints)
    r._ensure_refresh = lambda: None
    r._replica_queue_len_cache = {}
    r._outcomes = SimpleNamespace(inc=lambda tags: None)
    r._actor, r._view, r._view_at = FakeActor(), view, time.monotonic()
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
        assert actor.hints == [] and r._hinted == {} and r._announced == {}


def test_app_passes_hints_to_the_router():
    for hints in (True, False):
        config = replica_options(AppArgs(build_demo=False, hints=hints))["request_router_config"]
        assert config.request_router_kwargs == {"spread_after_s": 0.2, "hints": hints}


def test_a_request_routed_again_is_hinted_once_per_replica_until_it_completes():
    r, actor = router(True, VIEW)
    for _ in range(3):  # turned away by the full replica, it waits there again
        assert choose(r, pending("pirate", "r1")) == "a"
    assert sorted(actor.hints) == [("a", "pirate", "r1"), ("b", "pirate", "r1", "incoming")]
    r.on_request_completed(ReplicaId("a"), "r1")
    assert r._hinted == {} and r._announced == {}


def test_a_hinted_request_that_goes_elsewhere_withdraws_its_hint():
    r, actor = router(True, VIEW)
    assert choose(r, pending("pirate", "r1")) == "a"  # waits at the holder: hinted there
    assert choose(r, pending("pirate", "r1", waited_s=1.0)) == "b"  # spreads after all
    assert ("a", "pirate", "r1", "withdrawn") in actor.hints and "r1" not in r._hinted
