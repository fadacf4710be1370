"""Adapter-affinity request router with hints, running inside each caller (the ingress) of the
LoRA replicas. Serve calls `choose_replicas` for pending requests, again after each backoff while
the chosen replica is full: that is when the request is waiting in front of the replica, and when
the router sends the adapter hint so the load overlaps the wait.

Serve routes only the oldest pending requests at a time (two per replica), and calls
`choose_replicas` for those alone. A hint sent then leads its request by about one request's
service time, shorter than a remote fetch. So with hints on, the router asks Serve for routing
tasks for `hint_depth` more requests: those behind the front are placed and hinted `ahead` (the
replica fetches a remote adapter to its node, and no further), and never take a replica ahead of
an older request. Near the front, each is hinted `waiting`: the replica then brings the
adapter to its host cache and a device slot.

The view of the cluster comes from the RouterState actor (refreshed in the background) and from
this router's own recent placements. If the actor is unavailable, requests take the default
power-of-two-choices path until it returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, replace

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deploy.state import find_router_state
from routing.placement import Placement, ReplicaLoad, can_hint, place
from routing.wire import Hint, HintKind, ReplicaStats

log = logging.getLogger("ray.serve")
VIEW_STALE_S = 2.0
RECENT_S = 2.0  # a replica we just sent an adapter to counts as holding it for this long
BEHIND_RECHECK_S = 0.1  # a request behind the front is placed again this often (the front: Serve's backoff)
FORGET_AFTER_S = 60.0  # a request not routed for this long was cancelled: its record goes


@dataclass
class Waiting:
    """What the router keeps of one pending request, from its first routing attempt until a replica accepts it.
    Kept while a full replica turns it away, so that the replica it waits for is not hinted again."""

    request: PendingRequest
    adapter_id: str | None
    seen_at: float = 0.0  # its last routing attempt
    # Serve routes it now. Cleared once it goes to a replica: if that replica turns it away, Serve queues it again
    # with a new future but may give it no routing task while all tasks hold requests behind it, so it counts in
    # the queue order only from its next routing attempt (else those requests would wait for it, and it for them).
    routing: bool = True
    hinted_to: str | None = None  # the replica that holds its hint
    is_ahead: bool = False  # that hint is AHEAD: the request is far back in the queue
    holds_room: bool = False  # its WAITING hint counts against hinted_to's hint room (it has not been sent on)
    deferred: bool = False  # its hint is held back for lack of hint room (counted once)
    waits_for: str | None = None  # the full replica it waits for
    spread_to: str | None = None  # the replica told (INCOMING) that it may spread there

    @property
    def order(self) -> tuple[float, str]:
        return self.request.created_at, self.request.metadata.internal_request_id

    def forget_hint(self) -> None:
        self.hinted_to, self.is_ahead, self.holds_room = None, False, False


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, spread_after_s: float = 0.2, view_refresh_s: float = 0.05, hints: bool = True,
                         hint_depth: int = 48, **kwargs):
        """hints=False places requests exactly as with hints, but sends none (the benchmark's A0 arm), and routes
        as many requests at a time as Serve does. hint_depth: pending requests behind those that are hinted too."""
        self.spread_after_s = spread_after_s
        self.hints = hints
        self.hint_depth = hint_depth if hints else 0
        self._requests: dict[str, Waiting] = {}  # internal request id -> what is kept of it until a replica accepts it
        self.view_refresh_s = view_refresh_s
        self._view: dict[str, ReplicaStats] = {}
        self._view_at = 0.0
        self._actor = None
        self._refresh_task: asyncio.Task | None = None
        self._recent: dict[str, dict[str, float]] = {}  # adapter -> {replica uid: last placement}
        self._outcomes = None
        self._rng = random.Random()

    @property
    def max_num_routing_tasks(self) -> int:
        """Serve's own number of requests routed at a time (the front), plus hint_depth behind them."""
        return super().max_num_routing_tasks + self.hint_depth

    def _front(self, replicas: int) -> int:
        return min(self.max_num_routing_tasks_cap, 2 * replicas)  # RequestRouter.max_num_routing_tasks's own

    def _behind_front(self, waiting: Waiting, replicas: int) -> bool:
        """Whether `front` older requests wait in this router: this one may then only be hinted. Those behind
        take a replica in the order they came, as with Serve's own routing, and hints stay in queue order."""
        front = self._front(replicas)
        for w in self._requests.values():
            w.routing = w.routing and not w.request.future.done()  # sent on, or cancelled
        live = [w for w in self._requests.values() if w.routing]
        if len(live) <= front:
            return False
        return sum(w.order < waiting.order for w in live) >= front

    def _waiting(self, request: PendingRequest, now: float) -> Waiting:
        """The request's record, made at its first routing attempt."""
        rid = request.metadata.internal_request_id
        waiting = self._requests.get(rid)
        if waiting is None:
            waiting = self._requests[rid] = Waiting(request, request.metadata.multiplexed_model_id or None)
        waiting.request, waiting.seen_at, waiting.routing = request, now, True
        return waiting

    # --- view -----------------------------------------------------------------------------------

    def _ensure_refresh(self) -> None:
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            try:
                if self._actor is None:  # a GCS lookup: kept off the loop that routes requests
                    self._actor = await asyncio.to_thread(self._find_actor)
                view = await asyncio.wait_for(self._actor.view.remote(), timeout=1.0)
                self._view, self._view_at = view.replicas, time.monotonic()
            except Exception as e:  # actor restarting or gone: fall back until it is back
                log.debug("router view refresh failed: %r", e)
                self._actor = None
            self._prune(time.monotonic())
            await asyncio.sleep(self.view_refresh_s)

    def _prune(self, now: float) -> None:
        # Pending requests that were cancelled are never accepted: forget them once they stop being routed.
        self._requests = {rid: w for rid, w in self._requests.items() if now - w.seen_at < FORGET_AFTER_S}
        for adapter_id, uids in list(self._recent.items()):
            fresh = {uid: at for uid, at in uids.items() if now - at < RECENT_S}
            if fresh:
                self._recent[adapter_id] = fresh
            else:
                del self._recent[adapter_id]

    def _find_actor(self):
        context = serve.get_replica_context()  # the ingress's: Serve runs this router where the handle is
        return find_router_state(context.app_name, context.code_version)

    def _has_view(self) -> bool:
        return self._actor is not None and time.monotonic() - self._view_at < VIEW_STALE_S

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        uid = replica.replica_id.unique_id
        stats = self._view.get(uid) or ReplicaStats.from_dict(replica.routing_stats or {})
        ongoing = self._replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.ongoing
        return ReplicaLoad(uid, ongoing, replica.max_ongoing_requests, frozenset(stats.resident),
                           frozenset(stats.loading), frozenset(stats.queued), stats.free_slots, stats.hint_room)

    # --- routing --------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        self._ensure_refresh()
        now = time.monotonic()
        waiting = self._waiting(pending_request, now)
        behind = self.hint_depth > 0 and self._behind_front(waiting, len(candidate_replicas))
        if not self._has_view():
            if behind:
                await asyncio.sleep(BEHIND_RECHECK_S)
                return []
            self._count("fallback")
            return self._power_of_two(candidate_replicas)
        adapter_id, rid = waiting.adapter_id, pending_request.metadata.internal_request_id
        recent = frozenset(uid for uid, at in self._recent.get(adapter_id, {}).items() if now - at < RECENT_S)
        by_uid = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
        waiting_for = waiting.waits_for
        decision = place(adapter_id, list(loads.values()),
                         waited_s=time.time() - pending_request.created_at, spread_after_s=self.spread_after_s,
                         recent=recent, rng=self._rng, waiting_for=waiting_for)
        if behind:  # it waits whatever the replicas' load: older requests go first
            # and keeps the replica it was hinted to, unless another now holds its adapter: a target that
            # followed the replicas' loads moved on every attempt, each move a withdrawal and a new hint
            keep = waiting_for in by_uid and decision.outcome != "affinity"
            uid = waiting_for if keep else decision.uid
            decision = replace(decision, uid=uid, must_wait=True,
                               spread_to=None if decision.spread_to == uid else decision.spread_to)
        if waiting.hinted_to not in (None, decision.uid) and adapter_id is not None:
            # It waits for, or goes to, another replica now: the first one should not read or keep its adapter.
            self._actor.push_hint.remote(waiting.hinted_to, Hint(adapter_id, rid, HintKind.WITHDRAWN))
            waiting.forget_hint()
        waiting.waits_for = decision.uid if decision.must_wait else None
        if self.hints and adapter_id is not None:
            self._hint(decision, waiting, behind, loads[decision.uid].hint_room)
        if not decision.must_wait:
            waiting.holds_room = False  # sent on: the replica counts its adapter as busy in hint_room instead
            waiting.deferred = False
            self._count(decision.outcome)
            if adapter_id is not None:
                self._recent.setdefault(adapter_id, {})[decision.uid] = now
        if behind:
            await asyncio.sleep(BEHIND_RECHECK_S)
            return []  # Serve backs off and asks again
        return [[by_uid[decision.uid]]]

    def _hint(self, decision: Placement, waiting: Waiting, behind: bool, room: int | None) -> None:
        """The hints a placement calls for: the replica the request waits for (ahead if it is far back), and the
        replica it may spread to."""
        if decision.must_wait:
            if behind:
                if waiting.hinted_to is None:
                    self._hint_ahead(decision.uid, waiting)
            elif waiting.hinted_to is not None and not waiting.is_ahead:
                waiting.holds_room = True  # hinted there already, then turned away by the full replica: waits again
            else:  # new, or hinted far back and now near the front
                self._hint_waiting(decision.uid, waiting, room)
        if decision.spread_to and waiting.spread_to != decision.spread_to:
            # The request may spread there after spread_after_s: that replica keeps the adapter if it holds it.
            waiting.spread_to = decision.spread_to
            self._send(decision.spread_to, waiting, HintKind.INCOMING)

    def _hint_waiting(self, uid: str, waiting: Waiting, room: int | None) -> None:
        """Hint the replica the request waits for, within its hint room; else count it held back (once), and
        a later routing attempt (after Serve's backoff) tries again."""
        hinted = [w.adapter_id for w in self._requests.values() if w.hinted_to == uid and w.holds_room]
        if not can_hint(waiting.adapter_id, hinted, room):
            if not waiting.deferred:
                waiting.deferred = True
                self._count("hint_deferred")
            return
        waiting.hinted_to, waiting.is_ahead, waiting.holds_room, waiting.deferred = uid, False, True, False
        self._send(uid, waiting, HintKind.WAITING)
        self._count("hint")

    def _hint_ahead(self, uid: str, waiting: Waiting) -> None:
        """Hint a request far back in the queue: the replica fetches its adapter to the node and no further, so
        this costs no hint room (the host cache's); the replica's node cache bounds what it fetches ahead."""
        waiting.hinted_to, waiting.is_ahead = uid, True
        self._send(uid, waiting, HintKind.AHEAD)
        self._count("hint_ahead")

    def _send(self, uid: str, waiting: Waiting, kind: HintKind) -> None:
        hint = Hint(waiting.adapter_id, waiting.request.metadata.internal_request_id, kind)
        self._actor.push_hint.remote(uid, hint)  # fire and forget

    def _power_of_two(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Serve's default policy: two random replicas, the shorter queue first."""
        pair = self._rng.sample(candidates, min(2, len(candidates)))
        return [sorted(pair, key=lambda r: self._replica_queue_len_cache.get(r.replica_id) or 0)]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """The replica accepted the request: it has left this router for good."""
        super().on_request_routed(pending_request, replica_id, result)
        self._requests.pop(pending_request.metadata.internal_request_id, None)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Serve calls this when a request completes, and also when a full replica turns an attempt away (Ray 2.60
        cancels the rejected attempt, which fires its completion callback); the request then waits again. So only
        its place in the hint room is given back here: its hint record stays, so that a request turned away is not
        hinted to the same replica again (a duplicate hint at the replica is a stale entry in its prefetch demand
        until it expires) and is withdrawn there if it goes elsewhere. Records of accepted requests go in
        on_request_routed, those of any other once it has not been routed for FORGET_AFTER_S (`_prune`)."""
        waiting = self._requests.get(internal_request_id)
        if waiting is not None:
            waiting.holds_room = False

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._view.pop(replica_id.unique_id, None)
        for waiting in self._requests.values():
            if waiting.hinted_to == replica_id.unique_id:
                waiting.holds_room = False
            if waiting.waits_for == replica_id.unique_id:
                waiting.waits_for = None
        for uids in self._recent.values():
            uids.pop(replica_id.unique_id, None)

    def _count(self, outcome: str) -> None:
        if self._outcomes is None:
            from deploy.metrics import placements

            self._outcomes = placements()
        self._outcomes.inc(tags={"outcome": outcome})
