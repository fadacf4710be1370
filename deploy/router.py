"""Adapter-affinity request router with hints, running inside each caller (the ingress) of the
LoRA replicas. Serve calls `choose_replicas` for pending requests, again after each backoff while
the chosen replica is full: that is when the request is waiting in front of the replica, and when
the router sends the adapter hint so the load overlaps the wait.

Serve routes only the oldest pending requests at a time (two per replica), and calls
`choose_replicas` for those alone. A hint sent then leads its request by about one request's
service time, shorter than a remote fetch. So with hints on, the router asks Serve for routing
tasks for `hint_depth` more requests: those behind the front are placed and hinted `ahead` (the
replica fetches a remote adapter to its node, and no further), and never take a replica ahead of
an older request. Near the front, each is hinted `waiting`, as before: the replica then brings the
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
from dataclasses import replace

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deploy.state import find_router_state
from prefetch.placement import Placement, ReplicaLoad, can_hint, place

log = logging.getLogger("ray.serve")
VIEW_STALE_S = 2.0
RECENT_S = 2.0  # a replica we just sent an adapter to counts as holding it for this long
BEHIND_RECHECK_S = 0.1  # a request behind the front is placed again this often (the front: Serve's backoff)


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, spread_after_s: float = 0.2, view_refresh_s: float = 0.05, hints: bool = True,
                         hint_depth: int = 48, **kwargs):
        """hints=False places requests exactly as with hints, but sends none (the benchmark's A0 arm), and routes
        as many requests at a time as Serve does. hint_depth: pending requests behind those that are hinted too."""
        self.spread_after_s = spread_after_s
        self.hints = hints
        self.hint_depth = hint_depth if hints else 0
        self._pending: dict[str, PendingRequest] = {}  # internal request id -> request waiting here, to order them
        self._ahead: set[str] = set()  # internal request ids hinted far back ("ahead"), not yet near the front
        self.view_refresh_s = view_refresh_s
        self._view: dict[str, dict] = {}
        self._view_at = 0.0
        self._actor = None
        self._refresh_task: asyncio.Task | None = None
        # Kept until the replica accepts the request (or 60 s): a request that a full replica turns away waits
        # again, and the replica it waits for already has its hint.
        self._hinted: dict[str, tuple[str, float]] = {}  # internal request id -> (replica uid, when) hinted
        # The hint budget: requests still waiting in this router whose "waiting" hint a replica holds. A request
        # leaves it when it is sent on (the replica then counts its adapter as busy in hint_room).
        self._waiting_hints: dict[str, dict[str, str]] = {}  # replica uid -> {internal request id: adapter}
        self._deferred: dict[str, float] = {}  # internal request id -> when its hint was first held back
        self._waits_at: dict[str, tuple[str, float]] = {}  # internal request id -> (replica uid, since) it waits for
        self._announced: dict[str, tuple[str, float]] = {}  # internal request id -> (spread target, when) told
        self._recent: dict[str, dict[str, float]] = {}  # adapter -> {replica uid: last placement}
        self._outcomes = None
        self._rng = random.Random()

    @property
    def max_num_routing_tasks(self) -> int:
        """Serve's own number of requests routed at a time (the front), plus hint_depth behind them."""
        return super().max_num_routing_tasks + self.hint_depth

    def _front(self, replicas: int) -> int:
        return min(self.max_num_routing_tasks_cap, 2 * replicas)  # RequestRouter.max_num_routing_tasks's own

    def _behind_front(self, request: PendingRequest, replicas: int) -> bool:
        """Whether `front` older requests wait in this router: this one may then only be hinted. Those behind
        take a replica in the order they came, as with Serve's own routing, and hints stay in queue order."""
        self._pending = {rid: r for rid, r in self._pending.items() if not r.future.done()}
        self._pending[request.metadata.internal_request_id] = request
        front = self._front(replicas)
        if len(self._pending) <= front:
            return False
        key = (request.created_at, request.metadata.internal_request_id)
        older = sum((r.created_at, rid) < key for rid, r in self._pending.items())
        return older >= front

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
                self._view, self._view_at = view["replicas"], time.monotonic()
            except Exception as e:  # actor restarting or gone: fall back until it is back
                log.debug("router view refresh failed: %r", e)
                self._actor = None
            self._prune(time.monotonic())
            await asyncio.sleep(self.view_refresh_s)

    def _prune(self, now: float) -> None:
        # Pending requests that were cancelled never complete: forget their hints eventually.
        self._hinted = {rid: told for rid, told in self._hinted.items() if now - told[1] < 60.0}
        self._ahead &= self._hinted.keys()
        self._waiting_hints = {uid: live for uid, hints in self._waiting_hints.items()
                               if (live := {rid: a for rid, a in hints.items() if rid in self._hinted})}
        self._deferred = {rid: at for rid, at in self._deferred.items() if now - at < 60.0}
        self._waits_at = {rid: told for rid, told in self._waits_at.items() if now - told[1] < 60.0}
        self._announced = {rid: told for rid, told in self._announced.items() if now - told[1] < 60.0}
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
        stats = self._view.get(uid) or replica.routing_stats or {}
        ongoing = self._replica_queue_len_cache.get(replica.replica_id)
        if ongoing is None:
            ongoing = stats.get("ongoing", 0)
        return ReplicaLoad(uid, ongoing, replica.max_ongoing_requests, frozenset(stats.get("resident", ())),
                           frozenset(stats.get("loading", ())), frozenset(stats.get("queued", ())),
                           stats.get("free_slots", 0), stats.get("hint_room"))

    # --- routing --------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        self._ensure_refresh()
        behind = self.hint_depth > 0 and self._behind_front(pending_request, len(candidate_replicas))
        if not self._has_view():
            if behind:
                await asyncio.sleep(BEHIND_RECHECK_S)
                return []
            self._count("fallback")
            return self._power_of_two(candidate_replicas)
        adapter_id = pending_request.metadata.multiplexed_model_id or None
        rid = pending_request.metadata.internal_request_id
        now = time.monotonic()
        recent = frozenset(uid for uid, at in self._recent.get(adapter_id, {}).items() if now - at < RECENT_S)
        by_uid = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
        waiting_for = self._waits_at.get(rid, ("",))[0] or None
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
        hinted_at = self._hinted.get(rid, ("",))[0]
        if hinted_at and hinted_at != decision.uid and adapter_id is not None:
            # It waits for, or goes to, another replica now: the first one should not read or keep its adapter.
            self._actor.push_hint.remote(hinted_at, adapter_id, rid, "withdrawn")
            self._forget_hint(rid)
        if not decision.must_wait:
            self._waits_at.pop(rid, None)
        elif self._waits_at.get(rid, ("",))[0] != decision.uid:
            self._waits_at[rid] = (decision.uid, now)
        if self.hints and adapter_id is not None:
            self._hint(decision, adapter_id, rid, behind, loads[decision.uid].hint_room, now)
        if not decision.must_wait:
            self._waiting_hints.get(decision.uid, {}).pop(rid, None)  # sent on: no longer waits on the budget
            self._deferred.pop(rid, None)
            self._count(decision.outcome)
            if adapter_id is not None:
                self._recent.setdefault(adapter_id, {})[decision.uid] = now
        if behind:
            await asyncio.sleep(BEHIND_RECHECK_S)
            return []  # Serve backs off and asks again
        return [[by_uid[decision.uid]]]

    def _hint(self, decision: Placement, adapter_id: str, rid: str, behind: bool, room: int | None,
              now: float) -> None:
        """The hints a placement calls for: the replica the request waits for (ahead if it is far back), and the
        replica it may spread to."""
        if decision.must_wait:
            if behind:
                if rid not in self._hinted:
                    self._hint_ahead(decision.uid, adapter_id, rid, now)
            elif rid in self._hinted and rid not in self._ahead:
                # hinted there already, then turned away by the full replica: waits again
                self._waiting_hints.setdefault(decision.uid, {})[rid] = adapter_id
            else:  # new, or hinted far back and now near the front
                self._hint_waiting(decision.uid, adapter_id, rid, room, now)
        if decision.spread_to and self._announced.get(rid, ("",))[0] != decision.spread_to:
            # The request may spread there after spread_after_s: that replica keeps the adapter if it holds it.
            self._announced[rid] = (decision.spread_to, now)
            self._actor.push_hint.remote(decision.spread_to, adapter_id, rid, "incoming")

    def _hint_waiting(self, uid: str, adapter_id: str, rid: str, room: int | None, now: float) -> None:
        """Hint the replica the request waits for, within its hint room; else count it held back (once), and
        a later routing attempt (after Serve's backoff) tries again."""
        hints = self._waiting_hints.setdefault(uid, {})
        if not can_hint(adapter_id, hints.values(), room):
            if rid not in self._deferred:
                self._deferred[rid] = now
                self._count("hint_deferred")
            return
        hints[rid] = adapter_id
        self._hinted[rid] = (uid, now)
        self._ahead.discard(rid)
        self._deferred.pop(rid, None)
        self._actor.push_hint.remote(uid, adapter_id, rid)  # fire and forget
        self._count("hint")

    def _hint_ahead(self, uid: str, adapter_id: str, rid: str, now: float) -> None:
        """Hint a request far back in the queue: the replica fetches its adapter to the node and no further, so
        this costs no hint room (the host cache's); the replica's node cache bounds what it fetches ahead."""
        self._hinted[rid] = (uid, now)
        self._ahead.add(rid)
        self._actor.push_hint.remote(uid, adapter_id, rid, "ahead")
        self._count("hint_ahead")

    def _forget_hint(self, rid: str) -> None:
        uid, _ = self._hinted.pop(rid, ("", 0.0))
        self._ahead.discard(rid)
        self._waiting_hints.get(uid, {}).pop(rid, None)

    def _power_of_two(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Serve's default policy: two random replicas, the shorter queue first."""
        pair = self._rng.sample(candidates, min(2, len(candidates)))
        return [sorted(pair, key=lambda r: self._replica_queue_len_cache.get(r.replica_id) or 0)]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """The replica accepted the request: it has left this router for good."""
        super().on_request_routed(pending_request, replica_id, result)
        rid = pending_request.metadata.internal_request_id
        self._forget_hint(rid)
        self._pending.pop(rid, None)
        self._waits_at.pop(rid, None)
        self._announced.pop(rid, None)
        self._deferred.pop(rid, None)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """Serve calls this when a request completes, and also when a full replica turns an attempt away (Ray 2.60
        cancels the rejected attempt, which fires its completion callback); the request then waits again. So only
        its place in the hint room is given back here: its hint record stays, so that a request turned away is not
        hinted to the same replica again (a duplicate hint at the replica is a stale entry in its prefetch demand
        until it expires) and is withdrawn there if it goes elsewhere. Records of accepted requests go in
        on_request_routed, those of any other after 60 s (`_prune`)."""
        uid, _ = self._hinted.get(internal_request_id, ("", 0.0))
        self._waiting_hints.get(uid, {}).pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._view.pop(replica_id.unique_id, None)
        self._waiting_hints.pop(replica_id.unique_id, None)
        self._waits_at = {rid: told for rid, told in self._waits_at.items() if told[0] != replica_id.unique_id}
        for uids in self._recent.values():
            uids.pop(replica_id.unique_id, None)

    def _count(self, outcome: str) -> None:
        if self._outcomes is None:
            from deploy.metrics import placements

            self._outcomes = placements()
        self._outcomes.inc(tags={"outcome": outcome})
