"""What an engine reports: its routing stats (for the router) and its metrics (for Prometheus and the benches),
read from the engine's public state (`EngineState`), and the result of its last invariant check."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from app.adapters.registry import AdapterRegistry
from app.engine.model_runner import ModelRunner
from app.engine.scheduler import Scheduler
from app.engine.step_timing import StepTiming
from prefetch.metrics import Histogram
from prefetch.residency import Residency
from routing.placement import hint_room
from routing.wire import ReplicaStats

# The full invariant check walks every page of the host arena and the device pool, on the engine thread, and the
# routing stats are read several times a second: with requests in flight it runs this often, and the report
# carries the last result.
INVARIANTS_BUSY_EVERY_S = 10.0
ARRIVAL_COUNTERS = ("hint_hits", "inflight_hits", "misses", "hints_received", "hints_late", "hints_duplicate",
                    "hinted_on_device", "hinted_in_host", "hinted_from_disk")


class InvariantReport:
    """The engine's last full invariant check: "ok" or "violated: ...", refreshed while idle, or at most every
    INVARIANTS_BUSY_EVERY_S under load."""

    def __init__(self):
        self.checked_at, self.result = float("-inf"), "unchecked"

    def status(self, engine: EngineState) -> str:
        now = time.monotonic()
        if engine.has_requests() and now - self.checked_at < INVARIANTS_BUSY_EVERY_S:
            return self.result
        try:
            engine.check_invariants()
            self.result = "ok"
        except AssertionError as e:
            self.result = f"violated: {e}"
        self.checked_at = now
        return self.result


class EngineState(Protocol):
    """The public state of an engine (app/engine/engine.py) that its report reads."""

    device: torch.device
    steps: int
    scheduler: Scheduler
    runner: ModelRunner
    residency: Residency
    registry: AdapterRegistry
    invariants: InvariantReport
    timing: StepTiming
    hint_lead: Histogram
    adapter_wait: Histogram
    adapter_wait_before_load: Histogram
    first_token_time: Histogram
    request_time: Histogram

    def has_requests(self) -> bool: ...

    def check_invariants(self) -> None: ...


def routing_stats(engine: EngineState) -> ReplicaStats:
    """What the router needs to know about this replica (the replica adds its own call count and memory)."""
    snapshot = engine.residency.snapshot()
    waiting, running = engine.scheduler.waiting, engine.scheduler.running
    queued = {r.adapter_id for r in waiting if r.adapter_id is not None}
    busy = queued | {r.adapter_id for r in running if r.adapter_id is not None}
    host_adapters = engine.residency.host_capacity()
    return ReplicaStats(
        resident=tuple(snapshot["resident_adapters"]),
        loading=tuple(snapshot["loading_adapters"]),
        queued=tuple(sorted(queued)),
        free_slots=engine.residency.free_slots(),
        hint_room=hint_room(host_adapters, len(busy)),  # the router's budget of hinted adapters here
        running=len(running),
        waiting=len(waiting),
        pinned_slots=snapshot["slots_pinned"],
        host_cache_bytes=snapshot["host_cache_bytes"],
        host_cache_adapters=host_adapters,
        device=str(engine.device),
        invariants=engine.invariants.status(engine),
        arrivals={k: snapshot[k] for k in ARRIVAL_COUNTERS},
        hint_lead_seconds=engine.hint_lead.as_dict(),
        step_timing=engine.timing.summary(),
        node_cache=engine.registry.node_snapshot() if engine.registry.cache is not None else None,
    )


def node_cache(engine: EngineState) -> dict:
    """The node cache's counters, where the engine serves remote adapters."""
    return {"node_cache": engine.registry.node_snapshot()} if engine.registry.cache is not None else {}


def metrics(engine: EngineState, drain_stalls: bool = False) -> dict:
    """drain_stalls: also return (and forget) the stall durations not yet reported, as "stalls"."""
    stalls = {}
    if drain_stalls:
        events = engine.residency.metrics.unreported_stalls
        stalls = {"stalls": list(events)}
        events.clear()
    scheduler, runner = engine.scheduler, engine.runner
    return {
        **stalls,
        "steps": engine.steps,
        "overlapped_steps": engine.overlapped_steps,
        "queue_length": len(scheduler.waiting),
        "batch_size": len(scheduler.running),
        "kv_blocks_total": scheduler.blocks.num_blocks - 1,
        "kv_blocks_free": scheduler.blocks.free_count(),
        "preemptions": scheduler.preemptions,
        "prefix_shared_tokens": scheduler.shared_prefix_tokens,
        "decode_graphs": runner.graph_batches,
        "graph_capture_seconds": round(runner.capture_seconds, 2),
        "step_timing": engine.timing.summary(),
        "adapter_wait_seconds": engine.adapter_wait.as_dict(),
        "adapter_wait_before_load_seconds": engine.adapter_wait_before_load.as_dict(),
        "first_token_seconds": engine.first_token_time.as_dict(),
        "request_seconds": engine.request_time.as_dict(),
        "hint_lead_seconds": engine.hint_lead.as_dict(),
        **engine.residency.snapshot(),
        **node_cache(engine),
    }
