"""What an engine reports: its routing stats (for the router), its metrics (for Prometheus and the benches), and
one prompt's logits computed outside the batch (for tests and debugging)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from app.errors import AdapterLoadFailed, CapacityExceeded
from app.engine.request import Request
from app.sampling.params import SamplingParams
from app.engine.scheduler import Chunk, StepPlan
from prefetch.placement import hint_room

if TYPE_CHECKING:
    from app.engine.engine import LLMEngine


# The full invariant check walks every page of the host arena and the device pool (1.5 ms on the 2-core CI CPU
# for the tiny demo), on the engine thread, and the routing stats are read several times a second: with requests in
# flight it runs this often, and the report carries the last result.
INVARIANTS_BUSY_EVERY_S = 10.0


class InvariantReport:
    """The engine's last full invariant check: "ok" or "violated: ...", refreshed while idle, or at most every
    INVARIANTS_BUSY_EVERY_S under load."""

    def __init__(self):
        self.checked_at, self.result = float("-inf"), "unchecked"

    def status(self, engine: LLMEngine) -> str:
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


def routing_stats(engine: LLMEngine) -> dict:
    """What the router needs to know about this replica."""
    snapshot = engine.residency.snapshot()
    queued = {r.adapter_id for r in engine.waiting if r.adapter_id is not None}
    busy = queued | {r.adapter_id for r in engine.running if r.adapter_id is not None}
    host_adapters = engine.residency.host_capacity()
    return {
        "invariants": engine.invariants.status(engine),
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
        "arrivals": {k: snapshot[k] for k in ("hint_hits", "inflight_hits", "misses", "hints_received", "hints_late",
                                                 "hints_duplicate")},
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
        "adapter_wait_seconds": engine.adapter_wait.as_dict(),
        "adapter_wait_before_load_seconds": engine.adapter_wait_before_load.as_dict(),
        "first_token_seconds": engine.first_token_time.as_dict(),
        "request_seconds": engine.request_time.as_dict(),
        "hint_lead_seconds": engine.hint_lead.as_dict(),
        **engine.residency.snapshot(),
    }


def prompt_logits(engine: LLMEngine, prompt: str, adapter_id: str | None = None) -> torch.Tensor:
    """Logits [tokens, vocab] at every prompt position, outside the batch (tests, debugging)."""
    request = Request(f"logits-{next(engine._ids)}", adapter_id, engine.tokenizer(prompt)["input_ids"],
                      SamplingParams(max_tokens=1))
    if adapter_id is not None:
        engine.registry.get(adapter_id)
        while (slot := engine.residency.acquire(adapter_id, may_block=True)) is None:
            engine.residency.stall_for(adapter_id)
            engine.residency.poll()
            if failure := engine.residency.take_failures().get(adapter_id):
                raise AdapterLoadFailed(f"adapter {adapter_id!r} could not be loaded: {failure}")
        request.slot = slot
    n = request.num_tokens
    if not engine.blocks.can_allocate(request.request_id, n):
        engine._release(request)
        raise CapacityExceeded(f"the KV cache has no room for {n} tokens now", retry_after_s=1.0)
    engine.blocks.allocate(request.request_id, n)
    try:
        engine.residency.before_forward([request.slot] if request.slot is not None else [])
        return engine.runner.execute(StepPlan(prefill=[Chunk(request, 0, n)]), logits_all=True).float().cpu()
    finally:
        engine.blocks.release(request.request_id)
        engine._release(request)
