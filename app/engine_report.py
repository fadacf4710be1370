"""What an engine reports: its routing stats (for the router) and its metrics (for Prometheus and the benches)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefetch.placement import hint_room

if TYPE_CHECKING:
    from app.engine import LLMEngine


def routing_stats(engine: LLMEngine) -> dict:
    """What the router needs to know about this replica."""
    snapshot = engine.residency.snapshot()
    queued = {r.adapter_id for r in engine.waiting if r.adapter_id is not None}
    busy = queued | {r.adapter_id for r in engine.running if r.adapter_id is not None}
    host_adapters = engine.residency.host_capacity()
    try:
        engine.check_invariants()
        invariants = "ok"
    except AssertionError as e:
        invariants = f"violated: {e}"
    return {
        "invariants": invariants,
        "pinned_slots": snapshot["slots_pinned"],
        "host_cache_bytes": snapshot["host_cache_bytes"],
        "resident": snapshot["resident_adapters"],
        "loading": snapshot["loading_adapters"],
        "queued": sorted(queued),
        "running": len(engine.running),
        "waiting": len(engine.waiting),
        "free_slots": engine.residency.free_slots(),
        "host_cache_adapters": host_adapters,
        "hint_room": hint_room(host_adapters, len(busy)),  # the router's budget of hinted adapters here
        "device": str(engine.device),
        "arrivals": {k: snapshot[k] for k in ("hint_hits", "inflight_hits", "misses", "hints_received")},
        "hint_lead_seconds": engine.hint_lead.as_dict(),
        "step_timing": engine.timing.summary(),
    }

def metrics(engine: LLMEngine, drain_stalls: bool = False) -> dict:
    """drain_stalls: also return (and forget) the stall durations not yet reported, as "stalls"."""
    stalls = {}
    if drain_stalls:
        events = engine.residency.metrics.unreported_stalls
        stalls = {"stalls": list(events)}
        events.clear()
    return {
        **stalls,
        "steps": engine.steps,
        "queue_length": len(engine.waiting),
        "batch_size": len(engine.running),
        "kv_blocks_total": engine.blocks.num_blocks - 1,
        "kv_blocks_free": engine.blocks.free_count(),
        "preemptions": engine.scheduler.preemptions,
        "prefix_shared_tokens": engine.scheduler.shared_prefix_tokens,
        "decode_graphs": engine.runner.graph_batches,
        "graph_capture_seconds": round(engine.runner.capture_seconds, 2),
        "step_timing": engine.timing.summary(),
        "hint_lead_seconds": engine.hint_lead.as_dict(),
        **engine.residency.snapshot(),
    }
