"""Open-loop, real-time driver: feeds a trace to an LLMEngine between its steps and times every token.

The engine is single-threaded, so the driver is its loop, as AsyncEngine's thread would be: it
adds each request once its arrival time has passed, optionally hints its adapter `hint_lead_s`
earlier (the router's hint for a request still upstream), and steps whenever the engine has work.
Latencies count from the scheduled arrival, so time a request spent arriving during a long step
counts against the engine, as a client would see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from app.engine import LLMEngine
from app.sampling import SamplingParams
from bench.workloads import Arrival

COUNTERS = ("hint_hits", "inflight_hits", "misses", "hints_received", "loads_started", "evictions",
            "wasted_prefetches", "wasted_prefetch_bytes")


@dataclass
class RequestTrace:
    arrival_s: float  # scheduled, seconds after the run's start
    adapter: int | None
    prompt_len: int
    output_len: int
    token_s: list[float] = field(default_factory=list)  # when each token reached the driver
    finished_s: float | None = None
    arrival_kind: str | None = None  # hit | inflight | miss, as the engine classified it
    arrived_to_queue: bool = False  # requests were already waiting when it arrived


@dataclass
class RunRecord:
    requests: list[RequestTrace]
    metrics: dict  # engine counters over this run only (differences of engine.metrics())
    wall_s: float


def vocab_ids(tokenizer) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocab except special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def run_trace(engine: LLMEngine, arrivals: Sequence[Arrival], adapter_names: Sequence[str],
              prompts: Sequence[list[int]], hint_lead_s: float = 0.0,
              on_finish: Callable[[], None] | None = None) -> RunRecord:
    """Play `arrivals` against `engine` in real time; return per-request timings and the run's counters."""
    assert not engine.has_work(), "the engine must be idle before a run"
    traces = [RequestTrace(a.t_s, a.adapter, a.prompt_len, a.output_len) for a in arrivals]
    by_id: dict[str, RequestTrace] = {}
    counters = engine.residency.metrics
    before = engine.metrics()
    next_add = next_hint = 0
    hints_on = hint_lead_s > 0
    start = time.perf_counter()
    while next_add < len(arrivals) or engine.has_work():
        now = time.perf_counter() - start
        while hints_on and next_hint < len(arrivals) and arrivals[next_hint].t_s - hint_lead_s <= now:
            if arrivals[next_hint].adapter is not None:
                engine.hint([adapter_names[arrivals[next_hint].adapter]])
            next_hint += 1
        while next_add < len(arrivals) and arrivals[next_add].t_s <= now:
            a, trace = arrivals[next_add], traces[next_add]
            trace.arrived_to_queue = bool(engine.waiting)
            kinds = (counters.hint_hits, counters.inflight_hits, counters.misses)
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
            adapter_id = None if a.adapter is None else adapter_names[a.adapter]
            request = engine.add_request(prompts[next_add], adapter_id, params, request_id=f"r{next_add}")
            after = (counters.hint_hits, counters.inflight_hits, counters.misses)
            changed = [k for k, x, y in zip(("hit", "inflight", "miss"), kinds, after) if x != y]
            trace.arrival_kind = changed[0] if changed else None
            by_id[request.request_id] = trace
            next_add += 1
        if engine.has_work():
            outputs = engine.step()
            stamp = time.perf_counter() - start
            for output in outputs:
                if output.error is not None:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                trace = by_id[output.request_id]
                trace.token_s += [stamp] * len(output.token_ids)
                if output.finished:
                    trace.finished_s = stamp
                    if on_finish:
                        on_finish()
        else:  # idle: sleep until the next hint or arrival is due
            due = [arrivals[next_add].t_s] if next_add < len(arrivals) else []
            if hints_on and next_hint < len(arrivals):
                due.append(arrivals[next_hint].t_s - hint_lead_s)
            time.sleep(max(0.0, min(due) - (time.perf_counter() - start)) if due else 0.0)
    wall = time.perf_counter() - start
    return RunRecord(traces, metrics_delta(before, engine.metrics()), wall)


def metrics_delta(before: dict, after: dict) -> dict:
    """What happened between two engine.metrics() snapshots (all residency counters are cumulative)."""
    out = {k: after[k] - before[k] for k in COUNTERS}
    for name in ("stall_seconds", "hint_lead_seconds"):
        out[name] = {"count": after[name]["count"] - before[name]["count"],
                     "sum": after[name]["sum"] - before[name]["sum"],
                     "buckets": {b: after[name]["buckets"][b] - before[name]["buckets"][b]
                                 for b in after[name]["buckets"]}}
    tiers = {}
    for tier, fields in (("disk_to_host", ("bytes", "seconds", "reads", "cache_hits")),
                         ("host_to_device", ("bytes", "seconds"))):
        tiers[tier] = {f: after["tiers"][tier][f] - before["tiers"][tier][f] for f in fields}
    h2d = tiers["host_to_device"]
    h2d["gb_per_s"] = h2d["bytes"] / h2d["seconds"] / 1e9 if h2d["seconds"] > 0 else None
    out["tiers"] = tiers
    out["steps"] = after["steps"] - before["steps"]
    return out
