"""The router actor's state: one per application, a deployment-scoped actor of the LoRA replicas.

It keeps the cluster view (what each replica holds, loads and queues, and how busy it is), the
application's adapter registry, and one hint mailbox per replica. Replicas long-poll `exchange`
with their stats and get their hints back at once; routers read `view` and `push_hint`. What crosses is typed
(routing/wire.py).
Serve recreates the actor if it dies; replicas then restore the registry into the new one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict

import ray
from ray.actor import ActorHandle

from routing.wire import ClusterView, Hint, HintKind, ReplicaStats, SyncReply

STALE_S = 5.0  # a replica that has not reported for this long has left the view
SYNC_POLL_S = 0.01  # how often wait_synced looks at the replicas' reports
REPLICA_DEPLOYMENT = "LoRAReplica"
STATE_ACTOR = "router_state"  # its name among the LoRA replica deployment's actors
SERVE_NAMESPACE = "serve"


def find_router_state(app_name: str, code_version: str | None, *, own_version_only: bool = False) -> ActorHandle:
    """The application's RouterState actor: how the replicas, the ingress and the router all find it.

    Serve's public `serve.get_deployment_actor` finds only actors of the caller's own deployment, and the ingress
    (with the router that runs inside it) is another deployment. So everyone looks the actor up here by the name
    Serve gives a deployment actor, "SERVE_DEPLOYMENT_ACTOR::<app>::<deployment>::<code_version>::<name>".
    Serve keeps one such actor per code version while a rolling update replaces replicas. A replica must use its
    own version's (own_version_only), as `serve.get_deployment_actor` would give it. The ingress prefers its own
    version's, which is the replicas' under `serve deploy` (one code version per application) but not under
    `serve.run`; failing that, the last by name. Raises ValueError while there is none (not started yet, or
    being recreated), as ray.get_actor does.
    """
    prefix, suffix = f"SERVE_DEPLOYMENT_ACTOR::{app_name}::{REPLICA_DEPLOYMENT}::", f"::{STATE_ACTOR}"
    own = f"{prefix}{code_version}{suffix}"
    if own_version_only:
        return ray.get_actor(own, namespace=SERVE_NAMESPACE)
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == SERVE_NAMESPACE and a["name"].startswith(prefix)
                   and a["name"].endswith(suffix))
    if not names:
        raise ValueError(f"no {STATE_ACTOR} actor of {app_name}/{REPLICA_DEPLOYMENT} is running")
    return ray.get_actor(own if own in names else names[-1], namespace=SERVE_NAMESPACE)


class RouterState:
    def __init__(self, adapters: dict[str, str] | None = None):
        self.epoch = uuid.uuid4().hex  # changes when Serve recreates the actor
        self.adapters: dict[str, str] = dict(adapters or {})
        self.version = 1
        self.views: dict[str, ReplicaStats] = {}
        self.reported_at: dict[str, float] = {}  # replica -> when its stats came
        self.synced: dict[str, int] = {}  # replica -> the registry version it last reported in sync with
        self.mailboxes: dict[str, list[Hint]] = defaultdict(list)
        self._wakeups: dict[str, asyncio.Event] = {}
        self.hints_pushed = Counter()

    def _wakeup(self, uid: str) -> asyncio.Event:
        return self._wakeups.setdefault(uid, asyncio.Event())

    # --- replicas -------------------------------------------------------------------------------

    async def exchange(self, uid: str, stats: ReplicaStats, known: tuple | None, timeout_s: float = 0.5) -> SyncReply:
        """Record a replica's stats; return its hints (waiting up to timeout_s) and any registry change.

        known: the (epoch, version) of the registry the replica last synced; a registry change ends the wait."""
        self.views[uid], self.reported_at[uid] = stats, time.time()
        if known is not None and known[0] == self.epoch:
            self.synced[uid] = known[1]
        if self._is_current(known) and not self.mailboxes[uid]:
            wakeup = self._wakeup(uid)
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        hints, self.mailboxes[uid] = tuple(self.mailboxes[uid]), []
        adapters = None if self._is_current(known) else dict(self.adapters)
        return SyncReply(self.epoch, self.version, hints, adapters)

    def _is_current(self, known: tuple | None) -> bool:
        return known is not None and tuple(known) == (self.epoch, self.version)

    async def restore(self, adapters: dict[str, str]) -> int:
        """A replica re-seeds a recreated actor with the adapters it serves."""
        missing = {k: v for k, v in adapters.items() if k not in self.adapters}
        if missing:
            self.adapters.update(missing)
            self._changed()
        return self.version

    # --- routers --------------------------------------------------------------------------------

    async def view(self) -> ClusterView:
        now = time.time()
        for uid in [u for u, at in self.reported_at.items() if now - at > STALE_S]:
            self.forget_replica(uid)
        return ClusterView(self.epoch, dict(self.views))

    async def push_hint(self, uid: str, hint: Hint) -> None:
        self.mailboxes[uid].append(hint)
        if hint.kind is not HintKind.WITHDRAWN:
            self.hints_pushed[uid] += 1
        self._wakeup(uid).set()

    def forget_replica(self, uid: str) -> None:
        self.views.pop(uid, None)
        self.reported_at.pop(uid, None)
        self.synced.pop(uid, None)
        self.mailboxes.pop(uid, None)
        self._wakeups.pop(uid, None)

    # --- registry -------------------------------------------------------------------------------

    async def adapters_snapshot(self) -> dict:
        """The registry, and its adapters that no replica serves: `refused` {name: one replica's reason}."""
        return {"version": self.version, "adapters": dict(self.adapters), "refused": self.refused()}

    def refused(self) -> dict[str, str]:
        """The registered adapters that every live replica refuses for their files: a request for one can only
        fail. One replica that holds an adapter serves it, so it is refused only where all of them refuse it."""
        now = time.time()
        live = [self.views[u] for u, at in self.reported_at.items() if now - at <= STALE_S]
        if not live:
            return {}
        names = set(self.adapters).intersection(*(stats.refused for stats in live))
        return {name: live[0].refused[name] for name in sorted(names)}

    async def register(self, name: str, path: str) -> int | None:
        """The new registry version, or None if `name` is registered already. Check and write happen here, in the
        registry's one owner, with no await between them: concurrent registrations of a name get one success."""
        if name in self.adapters:
            return None
        self.adapters[name] = path
        return self._changed()

    async def unregister(self, name: str) -> int | None:
        """The new registry version, or None if `name` is not registered."""
        if self.adapters.pop(name, None) is None:
            return None
        return self._changed()

    def _changed(self) -> int:
        self.version += 1
        for wakeup in self._wakeups.values():  # replicas long-polling `exchange` take the change at once
            wakeup.set()
        return self.version

    async def wait_synced(self, version: int, timeout_s: float) -> bool:
        """Wait until every live replica has reported the registry at `version` or later; False on timeout.

        A replica reports after it has brought its engine in line, or has marked a name whose old weights are
        still in use as refused, so a registration answered after this holds on every replica."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.time()
            behind = [u for u, at in self.reported_at.items()
                      if now - at <= STALE_S and self.synced.get(u, 0) < version]
            if not behind:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(SYNC_POLL_S)

    async def stats(self) -> dict:
        return {"epoch": self.epoch, "version": self.version, "replicas": sorted(self.views),
                "hints_pushed": dict(self.hints_pushed)}
