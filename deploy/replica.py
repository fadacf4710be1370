"""The LoRA replica deployment: one engine per replica, reporting to and taking hints from the router actor."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from operator import methodcaller

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve._private.utils import get_deployment_actor_name

from app.engine.async_engine import AsyncEngine
from app.engine.process import DiscardResult, EngineProcess
from app.engine.engine import LLMEngine
from app.errors import AdapterError, InternalError, ServingError
from app.api.fanout import generate_choices, merge_chunks, output_chunk
from app.sampling.params import SamplingParams
from deploy import metrics
from deploy.args import AppArgs

log = logging.getLogger("ray.serve")
STATE_ACTOR = "router_state"
POLL_TIMEOUT_S = 0.5
ARRIVAL_KINDS = {"hint_hits": "hit", "inflight_hits": "inflight", "misses": "miss"}  # engine counter -> metric tag
HINTED_TIERS = {"hinted_on_device": "device", "hinted_in_host": "host", "hinted_from_disk": "disk"}
SWITCH_INTERVAL_S = 0.0005


class LoRAReplica:
    async def __init__(self, args: dict):
        # The engine thread shares the GIL with Ray's event loop; the default 5 ms switch interval
        # lets a busy loop hold the engine back for 5 ms at every CUDA sync or torch op boundary.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.args = AppArgs(**args)
        context = serve.get_replica_context()
        self.uid = context.replica_id.unique_id
        self.state_actor_name = get_deployment_actor_name(
            context.replica_id.deployment_id, STATE_ACTOR, code_version=context.code_version)
        config = self.args.engine_config()
        if self.args.engine_in_process():  # the engine loop in its own process: no GIL shared with this event loop
            self.engine = await asyncio.to_thread(EngineProcess, config)
        else:
            self.engine = AsyncEngine(await asyncio.to_thread(LLMEngine, config))
        self.engine.stream_interval_s = self.args.stream_interval_ms / 1000
        self.adapters: dict[str, str] = {}
        await self._sync_adapters(self.args.initial_adapters())
        self._known: tuple | None = None
        self._reported = dict.fromkeys(ARRIVAL_KINDS | HINTED_TIERS, 0)
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

    async def generate(self, body: dict) -> dict:
        """Whole completion: {"choices": one merged chunk per choice, "replica"} or {"error"}."""
        chunks = []
        async for chunk in self.stream(body):
            if "error" in chunk:
                return chunk
            chunks.append(chunk)
        return {"choices": merge_chunks(chunks), "replica": self.uid}

    async def stream(self, body: dict):
        """Yields each choice's chunks (app/api/fanout.py's output_chunk, with "replica"), or one {"error"}."""
        try:
            params = SamplingParams(**body["params"])
            adapter_id = body.get("adapter_id")
            if adapter_id is not None and adapter_id not in self.adapters:
                await self._adopt(adapter_id)  # registered moments ago, not yet synced here
            async for index, output in generate_choices(self.engine, body["prompts"], adapter_id, params,
                                                        body.get("n", 1), body.get("request_id"), _hint_id()):
                yield {**output_chunk(index, output), "replica": self.uid}
        except Exception as e:
            if not isinstance(e, ServingError):  # a bug, not the client's fault: keep serving
                log.exception("request %s failed", body.get("request_id"))
                e = InternalError(f"internal error: {type(e).__name__}")
            yield {"error": e.to_openai()["error"], "status": e.status_code, "retry_after_s": e.retry_after_s,
                   "replica": self.uid}

    # --- what the router and the controller see -------------------------------------------------

    def record_replica_metadata(self) -> dict:
        return {"state_actor": self.state_actor_name, "uid": self.uid}

    async def record_routing_stats(self) -> dict:
        return await self.engine.call(methodcaller("routing_stats"))

    async def check_health(self) -> None:
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop has died")

    async def engine_metrics(self) -> dict:
        return {"replica": self.uid, **await self.engine.call(methodcaller("metrics"))}

    async def check_invariants(self) -> dict:
        await self.engine.call(methodcaller("check_invariants"))
        return {"replica": self.uid, "ok": True}

    # --- registry -------------------------------------------------------------------------------

    async def _sync_adapters(self, wanted: dict[str, str]) -> None:
        """Make this replica's registry equal `wanted` (the application's registry)."""
        for name in [n for n in self.adapters if n not in wanted]:
            try:
                await self.engine.call(methodcaller("unregister_adapter", name))
                del self.adapters[name]
            except AdapterError as e:  # in use: retried on the next sync
                log.info("deferring unregister of %s: %s", name, e)
        for name, path in wanted.items():
            if self.adapters.get(name) == path:
                continue
            try:
                if name in self.adapters:
                    await self.engine.call(methodcaller("unregister_adapter", name))
                await self.engine.call_aside(DiscardResult(methodcaller("register_adapter", name, path)))
                self.adapters[name] = path
            except ServingError as e:
                log.warning("adapter %s at %s refused: %s", name, path, e)

    async def _adopt(self, adapter_id: str) -> None:
        try:
            snapshot = await self._state().adapters_snapshot.remote()
        except Exception:
            return  # the engine answers with its own AdapterNotFound
        if adapter_id in snapshot["adapters"]:
            await self._sync_adapters({**self.adapters, adapter_id: snapshot["adapters"][adapter_id]})

    def _state(self):
        return ray.get_actor(self.state_actor_name, namespace="serve")

    async def _sync_loop(self) -> None:
        """Report stats, take hints and registry changes from the router actor, export metrics."""
        actor = None
        while True:
            try:
                actor = actor or self._state()
                stats = {**await self.engine.call(methodcaller("routing_stats")), "rss_bytes": _rss_bytes()}
                reply = await actor.exchange.remote(self.uid, stats, self._known, POLL_TIMEOUT_S)
                if reply["hints"]:
                    by_kind = {kind: [h for h in reply["hints"] if h.get("kind", "waiting") == kind]
                               for kind in ("waiting", "incoming", "withdrawn")}
                    ids = {kind: [h.get("request_id") or None for h in hints] for kind, hints in by_kind.items()}
                    adapters = {kind: [h["adapter_id"] for h in hints] for kind, hints in by_kind.items()}
                    self.engine.hint(adapters["waiting"], adapters["incoming"], adapters["withdrawn"],
                                     ids["waiting"], ids["withdrawn"])
                if "adapters" in reply:
                    if self._known is not None and reply["epoch"] != self._known[0]:
                        await actor.restore.remote(self.adapters)  # a recreated actor lost registrations
                        self._known = None
                        continue
                    await self._sync_adapters(reply["adapters"])
                    self._known = (reply["epoch"], reply["version"])
                await self._export_metrics()
            except (RayActorError, ValueError, asyncio.TimeoutError) as e:
                log.debug("router actor unavailable: %r", e)
                actor = None
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
