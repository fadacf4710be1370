"""Turns a RunRecord into the numbers the benchmark reports."""

from __future__ import annotations

import numpy as np

from bench.engine.driver import RunRecord


def percentiles(values, qs=(50, 99)) -> dict:
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def hit_rate(kinds: list[str | None]) -> float | None:
    """Share of arrivals whose adapter was resident or already loading: (hint + inflight hits) / arrivals."""
    kinds = [k for k in kinds if k is not None]
    return sum(k in ("hit", "inflight") for k in kinds) / len(kinds) if kinds else None


def summarize(record: RunRecord) -> dict:
    done = [r for r in record.requests if r.finished_s is not None]
    ttft = [r.token_s[0] - r.arrival_s for r in done]
    e2e = [r.finished_s - r.arrival_s for r in done]
    itl = [b - a for r in done for a, b in zip(r.token_s, r.token_s[1:])]
    first, last = min(r.arrival_s for r in record.requests), max(r.finished_s for r in done)
    span = max(last - first, 1e-9)
    tokens = sum(len(r.token_s) for r in done)
    m = record.metrics
    with_adapter = [r for r in record.requests if r.adapter is not None]
    queued = [r for r in with_adapter if r.arrived_to_queue]
    lead = m["hint_lead_seconds"]
    leads = sorted(r.hint_lead_s for r in with_adapter if r.hint_lead_s is not None)
    return {
        "requests": len(record.requests),
        "completed": len(done),
        "wall_s": record.wall_s,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
        "request_throughput_per_s": len(done) / span,
        "token_throughput_per_s": tokens / span,
        "stall_s_per_request": m["stall_seconds"]["sum"] / len(record.requests),
        "stalls": m["stall_seconds"]["count"],
        # Share of arrivals whose adapter was resident or already loading; "queued": arrivals that found
        # requests waiting in the engine, the ones a load started ahead of them could serve sooner.
        "hint_hit_rate": hit_rate([r.arrival_kind for r in with_adapter]),
        "hint_hit_rate_when_queued": hit_rate([r.arrival_kind for r in queued]),
        "arrivals_when_queued": len(queued),
        "arrival_kinds": {k: sum(r.arrival_kind == k for r in with_adapter) for k in ("hit", "inflight", "miss")},
        # Hint to arrival: the engine's histogram (hints its arrivals consumed) and the driver's own samples.
        "hint_lead_s_mean": lead["sum"] / lead["count"] if lead["count"] else None,
        "hint_lead_s": {**percentiles(leads), "count": len(leads)},
        "hint_lead_histogram": lead,
        "hint_lead_samples_s": leads,  # for the hint-lead plot
        "hints_received": m["hints_received"],
        "load_s": {**percentiles(record.load_s), "count": len(record.load_s)},  # a load's start to ready
        # Device bytes loaded and never used: evicted unused during the run, or still unused at its end.
        "wasted_prefetch_bytes": m["wasted_prefetch_bytes"] + record.unused_resident_bytes,
        "wasted_prefetch_bytes_evicted": m["wasted_prefetch_bytes"],
        "unused_resident_bytes_at_end": record.unused_resident_bytes,
        "wasted_prefetches": m["wasted_prefetches"],
        "loads": m["loads_started"],
        "evictions": m["evictions"],
        "h2d_gb_per_s": m["tiers"]["host_to_device"]["gb_per_s"],
        "tiers": m["tiers"],
        "steps": m["steps"],
        "ttft_samples_s": sorted(ttft),  # for the CDF plot
    }
