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

from app.api.fanout import generate_choices, output_chunk
from app.api.wire import ChoiceChunk, ErrorReply, GenerateCall
from app.engine.registry_mirror import RETRY_REFUSED_S, RegistryMirror
from app.errors import InternalError, ServingError
from deploy import metrics
from deploy.args import AppArgs
from deploy.state import find_router_state
from routing.wire import ReplicaStats

log = logging.getLogger("ray.serve")
POLL_TIMEOUT_S = 0.5
FIRST_REGISTRY_S = 30.0
SNAPSHOT_TIMEOUT_S = 10.0
METRICS_EVERY_S = 0.5  # how often the engine's metrics go to Prometheus (each read takes the engine thread's time)
ARRIVAL_KINDS = {"hint_hits": "hit", "inflight_hits": "inflight", "misses": "miss"}  # engine counter -> metric tag
HINTED_TIERS = {"hinted_on_device": "device", "hinted_in_host": "host", "hinted_from_disk": "disk",
                "hinted_from_store": "store"}


class LoRAReplica:
    async def __init__(self, args: dict):
        # The engine's modules (torch, the model code) load here, in the replica, and not where this module is
        # imported for the class alone: Serve's build task, on the path of every deploy.
        from app.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine, freeze_heap
        from app.engine.engine import LLMEngine
        from app.engine.process import EngineProcess

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
        self._ongoing = 0  # calls in stream(), which Serve counts against max_ongoing_requests
        self.registry = RegistryMirror(self.engine, self._registry_snapshot)
        await self.registry.sync(await self._first_registry())
        self._log_registry()
        self._retried_at = time.monotonic()  # when the adapters refused for their files were last tried again
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
            if call.adapter_id is not None and not self.registry.is_current(call.adapter_id):
                await self.registry.adopt(call.adapter_id)
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
        return replace(stats, ongoing=self._ongoing, rss_bytes=_rss_bytes(), refused=self.registry.refusals())

    async def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop has died")

    async def engine_metrics(self) -> dict:
        return {"replica": self.uid, **await self.engine.call(methodcaller("metrics"))}

    async def check_invariants(self) -> dict:
        await self.engine.call(methodcaller("check_invariants"))
        return {"replica": self.uid, "ok": True}

    # --- registry -------------------------------------------------------------------------------

    async def _registry_snapshot(self) -> dict[str, str] | None:
        """The application's registry from its owner, the router actor; None while it is unreachable."""
        try:
            actor = await self._state()
            return (await asyncio.wait_for(actor.adapters_snapshot.remote(), SNAPSHOT_TIMEOUT_S))["adapters"]
        except Exception:  # noqa: BLE001 - restarting or gone: the caller goes by what it has
            self._router_state = None
            return None

    async def _first_registry(self) -> dict[str, str]:
        """The registry this replica starts with. Serve starts the router actor with the deployment; should it
        not answer within FIRST_REGISTRY_S, the replica starts empty and its first report fills the registry."""
        deadline = time.monotonic() + FIRST_REGISTRY_S
        while (snapshot := await self._registry_snapshot()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return snapshot or {}

    def _log_registry(self) -> None:
        """One line at start: what the replica serves, and why it refused what it did not take."""
        refused = self.registry.refused
        log.log(logging.WARNING if refused else logging.INFO, "registered %d of %d adapters%s",
                len(self.registry.held), len(self.registry.wanted),
                "".join(f"; refused {name}: {why}" for name, why in sorted(refused.items())))

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
                        await actor.restore.remote(self.registry.wanted)  # a recreated actor lost registrations
                        self._known = None
                        continue
                    await self.registry.sync(reply.adapters)
                    self._known = (reply.epoch, reply.version)
                elif self.registry.deferred:
                    await self.registry.retry_deferred()
                if self.registry.refusals() and time.monotonic() - self._retried_at >= RETRY_REFUSED_S:
                    self._retried_at = time.monotonic()  # fixing an adapter's files needs no restart
                    await self.registry.retry_refused()
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
