"""The LoRA replica deployment: one engine per replica, reporting to and taking hints from the router actor."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from operator import methodcaller

from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from app.adapters.registry import VALIDATIONS_AT_ONCE
from app.api.fanout import generate_choices, output_chunk
from app.api.wire import ChoiceChunk, ErrorReply, GenerateCall
from app.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine, freeze_heap
from app.engine.process import DiscardResult, EngineProcess
from app.engine.engine import LLMEngine
from app.errors import AdapterInUse, AdapterNotFound, EngineUnavailable, InternalError, ServingError
from deploy import metrics
from deploy.args import AppArgs
from deploy.state import find_router_state
from routing.wire import ReplicaStats

log = logging.getLogger("ray.serve")
POLL_TIMEOUT_S = 0.5
METRICS_EVERY_S = 0.5  # how often the engine's metrics go to Prometheus (each read takes the engine thread's time)
ARRIVAL_KINDS = {"hint_hits": "hit", "inflight_hits": "inflight", "misses": "miss"}  # engine counter -> metric tag
HINTED_TIERS = {"hinted_on_device": "device", "hinted_in_host": "host", "hinted_from_disk": "disk",
                "hinted_from_store": "store"}


class LoRAReplica:
    async def __init__(self, args: dict):
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # an engine thread here shares the GIL with Ray's event loop
        self.args = AppArgs(**args)
        context = serve.get_replica_context()
        self.uid = context.replica_id.unique_id
        self.app_name, self.code_version = context.app_name, context.code_version
        self._router_state: ActorHandle | None = None
        config = self.args.engine_config()
        if self.args.engine_in_process():  # the engine loop in its own process: no GIL shared with this event loop
            self.engine = await asyncio.to_thread(EngineProcess, config)
        else:
            self.engine = AsyncEngine(await asyncio.to_thread(LLMEngine, config))
        self.engine.stream_interval_s = self.args.stream_interval_ms / 1000
        self.adapters: dict[str, str] = {}  # name -> path, as the engine has it registered
        self._wanted: dict[str, str] = {}  # name -> path, as the application's registry has it
        self._deferred: set[str] = set()  # names whose change waits for their requests to finish
        self._registry_lock = asyncio.Lock()
        self._ongoing = 0  # calls in stream(), which Serve counts against max_ongoing_requests
        await self._sync_adapters(self.args.initial_adapters())
        await self.engine.call(freeze_heap)  # the engine and its adapters live as long as the process
        self._known: tuple | None = None
        self._reported = dict.fromkeys(ARRIVAL_KINDS | HINTED_TIERS, 0)
        self._exported_at = float("-inf")  # when the engine's metrics last went to Prometheus
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_loop())

    def __del__(self):
        """Serve's graceful shutdown, once in-flight requests have drained (or garbage collection): stop the engine
        loop, and with `engine_process` its child, before Ray ends this process. Without it every scale-down and
        redeploy of an `engine_process` replica logged the child's end as a death."""
        task = self.__dict__.pop("_sync_task", None)
        if task is None:
            return  # never fully started, or shut down already
        try:
            task.cancel()
        except RuntimeError:  # its event loop is closed already
            pass
        self.engine.shutdown()

    # --- requests (called by the ingress) -------------------------------------------------------

    async def stream(self, call: GenerateCall) -> AsyncIterator[ChoiceChunk | ErrorReply]:
        """Each choice's chunks as they come, or one ErrorReply (then nothing more)."""
        self._ongoing += 1
        try:
            if call.adapter_id is not None and not self._is_current(call.adapter_id):
                await self._adopt(call.adapter_id)
            async for index, output in generate_choices(self.engine, call.prompts, call.adapter_id, call.params,
                                                        call.n, call.request_id, _hint_id()):
                yield output_chunk(index, output, self.uid)
        except Exception as e:
            if not isinstance(e, ServingError):  # a bug, not the client's fault: keep serving
                log.exception("request %s failed", call.request_id)
                e = InternalError(f"internal error: {type(e).__name__}")
            yield ErrorReply.of(e)
        finally:
            self._ongoing -= 1

    # --- what the router and the controller see -------------------------------------------------

    async def record_routing_stats(self) -> dict:
        """Serve's copy of the stats, which its controller keeps without importing routing.wire: a dict."""
        return (await self._stats()).to_dict()

    async def _stats(self) -> ReplicaStats:
        stats = await self.engine.call(methodcaller("routing_stats"))
        return replace(stats, ongoing=self._ongoing, rss_bytes=_rss_bytes())

    async def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop has died")

    async def engine_metrics(self) -> dict:
        return {"replica": self.uid, **await self.engine.call(methodcaller("metrics"))}

    async def check_invariants(self) -> dict:
        await self.engine.call(methodcaller("check_invariants"))
        return {"replica": self.uid, "ok": True}

    # --- registry -------------------------------------------------------------------------------

    def _is_current(self, name: str) -> bool:
        return name in self.adapters and self._wanted.get(name) == self.adapters[name]

    async def _sync_adapters(self, wanted: dict[str, str]) -> None:
        """Make this replica's registry equal `wanted` (the application's registry), as far as it can now."""
        async with self._registry_lock:
            self._wanted = dict(wanted)
            for name in [n for n in self.adapters if n not in wanted]:
                await self._sync_one(name)
            # At once, a few at a time: a remote adapter's validation waits a round trip to its store, and
            # hundreds of them one after another would hold a replica's start for a minute.
            gate = asyncio.Semaphore(VALIDATIONS_AT_ONCE)

            async def sync(name: str) -> None:
                async with gate:
                    await self._sync_one(name)

            await asyncio.gather(*(sync(name) for name in wanted))

    async def _sync_one(self, name: str) -> None:
        """Bring the engine's registration of `name` to self._wanted's (caller holds the registry lock).

        The engine keeps an adapter while requests use it; until they finish, the name stays deferred, requests
        for it are refused (see _adopt), and the sync loop retries."""
        held, path = self.adapters.get(name), self._wanted.get(name)
        if held == path:
            self._deferred.discard(name)
            return
        if held is not None:
            try:
                await self.engine.call(methodcaller("unregister_adapter", name))
            except AdapterInUse as e:
                if name not in self._deferred:
                    log.info("deferring the change of adapter %s until its requests finish: %s", name, e)
                    self._deferred.add(name)
                return
            except AdapterNotFound:
                pass
            del self.adapters[name]
            self._deferred.discard(name)
        if path is not None:
            try:
                await self.engine.call_aside(DiscardResult(methodcaller("register_adapter", name, path)))
                self.adapters[name] = path
            except ServingError as e:
                log.warning("adapter %s at %s refused: %s", name, path, e)

    async def _retry_deferred(self) -> None:
        async with self._registry_lock:
            for name in list(self._deferred):
                await self._sync_one(name)

    async def _adopt(self, adapter_id: str) -> None:
        """A request for a name this replica does not hold as the registry does: registered moments ago and not
        yet synced here, or changed while requests use its old weights. Serve it from the registry's current
        entry, or refuse it; never with weights the registry no longer names."""
        async with self._registry_lock:
            try:
                snapshot = await (await self._state()).adapters_snapshot.remote()
            except Exception:
                snapshot = None  # the registry is unreachable: go by the last one this replica saw
            if snapshot is not None:
                if adapter_id in snapshot["adapters"]:
                    self._wanted[adapter_id] = snapshot["adapters"][adapter_id]
                else:
                    self._wanted.pop(adapter_id, None)
            await self._sync_one(adapter_id)
            if adapter_id not in self.adapters or self._is_current(adapter_id):
                return  # current, or the engine answers with its own AdapterNotFound
            if adapter_id not in self._wanted:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not registered")
            raise EngineUnavailable(f"adapter {adapter_id!r} was registered again to {self._wanted[adapter_id]}; "
                                    "requests still use its previous weights here; retry shortly", retry_after_s=1)

    async def _state(self) -> ActorHandle:
        """The router actor, looked up again after _sync_loop drops a dead one (Serve recreates it)."""
        if self._router_state is None:
            self._router_state = await asyncio.to_thread(find_router_state, self.app_name, self.code_version,
                                                           own_version_only=True)
        return self._router_state

    async def _sync_loop(self) -> None:
        """Report stats, take hints and registry changes from the router actor, export metrics."""
        while True:
            try:
                actor = await self._state()
                reply = await actor.exchange.remote(self.uid, await self._stats(), self._known, POLL_TIMEOUT_S)
                if reply.hints:
                    self.engine.hint(list(reply.hints))
                if reply.adapters is not None:
                    if self._known is not None and reply.epoch != self._known[0]:
                        await actor.restore.remote(self._wanted)  # a recreated actor lost registrations
                        self._known = None
                        continue
                    await self._sync_adapters(reply.adapters)
                    self._known = (reply.epoch, reply.version)
                elif self._deferred:
                    await self._retry_deferred()
                if time.monotonic() - self._exported_at >= METRICS_EVERY_S:  # hints can end a poll many times a second
                    self._exported_at = time.monotonic()
                    await self._export_metrics()
            except (RayActorError, ValueError, asyncio.TimeoutError) as e:
                log.debug("router actor unavailable: %r", e)
                self._router_state = None
                await asyncio.sleep(0.5)
            except Exception:
                log.exception("replica sync failed")
                await asyncio.sleep(0.5)

    async def _export_metrics(self) -> None:
        snapshot = await self.engine.call(methodcaller("metrics", drain_stalls=True))
        for counter, tag, names in ((metrics.residency(), "kind", ARRIVAL_KINDS),
                                    (metrics.hinted_arrivals(), "tier", HINTED_TIERS)):
            for key, name in names.items():
                delta = snapshot[key] - self._reported[key]
                if delta:
                    counter.inc(delta, tags={tag: name})
                    self._reported[key] = snapshot[key]
        for seconds in snapshot["stalls"]:
            metrics.stalls().observe(seconds)
        for state in ("ready", "loading", "pinned", "total"):
            metrics.slots().set(snapshot[f"slots_{state}"], tags={"state": state})


def _hint_id() -> str | None:
    """The id the router's hint for the current request carries: Serve's internal request id, which the router sees
    as `PendingRequest.metadata.internal_request_id` and the replica only in Serve's private request context (None
    if a Ray version lacks it: the request then consumes no hint by id)."""
    try:
        return serve.context._get_serve_request_context()._internal_request_id or None
    except Exception:  # noqa: BLE001 - a private API: its absence only costs the exact hint match
        return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
