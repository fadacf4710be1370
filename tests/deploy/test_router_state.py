"""The router actor's state as a plain object, without Ray: which registered adapters no replica serves."""

import asyncio

from deploy import state
from deploy.state import RouterState
from routing.wire import ReplicaStats

GHOST, WIDE = "adapter 'ghost': no such directory", "adapter 'wide': rank 32 > max_rank 16 (set max_rank >= 32)"


def report(router: RouterState, uid: str, refused: dict[str, str]) -> None:
    asyncio.run(router.exchange(uid, ReplicaStats(refused=refused), known=None))  # known=None: answers at once


def refused(router: RouterState) -> dict[str, str]:
    return asyncio.run(router.adapters_snapshot())["refused"]


def test_an_adapter_is_refused_only_where_every_live_replica_refuses_it(monkeypatch):
    router = RouterState({"ghost": "/a/ghost", "wide": "/a/wide", "good": "/a/good"})
    assert refused(router) == {}  # no replica has reported
    report(router, "r1", {"ghost": GHOST, "wide": WIDE})
    report(router, "r2", {"ghost": GHOST})  # r2 serves wide
    assert refused(router) == {"ghost": GHOST}
    now = state.time.time()
    monkeypatch.setattr(state.time, "time", lambda: now + state.STALE_S + 1)
    report(router, "r1", {"ghost": GHOST, "wide": WIDE})  # r2 has left: r1 alone decides
    assert refused(router) == {"ghost": GHOST, "wide": WIDE}


def test_a_name_unregistered_since_a_replica_refused_it_is_not_listed():
    router = RouterState({"good": "/a/good"})
    report(router, "r1", {"ghost": GHOST})
    assert refused(router) == {}
