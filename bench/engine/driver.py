"""Open-loop, real-time driver: feeds a trace to an LLMEngine between its steps and times every token.

The engine is single-threaded, so the driver is its loop, as AsyncEngine's thread would be: it
adds each request once its arrival time has passed, optionally hints its adapter `hint_lead_s`
earlier (the router's hint for a request still upstream), and steps whenever the engine has work,
as AsyncEngine does (it steps without pause while a load is in flight, since has_work() counts
loads). `idle_poll_s` > 0 instead sleeps that long when only loads are in flight, which is what
AsyncEngine's IDLE_POLL_S appears meant to do.
Latencies count from the scheduled arrival, so time a request spent arriving during a long step
counts against the engine, as a client would see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from app.engine.engine import LLMEngine
from app.sampling.params import SamplingParams
from bench.workloads import Arrival
from routing.wire import Hint

HISTOGRAMS = ("stall_seconds", "hint_lead_seconds", "adapter_wait_seconds", "adapter_wait_before_load_seconds",
              "first_token_seconds", "request_seconds")
COUNTERS = ("hint_hits", "inflight_hits", "misses", "hinted_on_device", "hinted_in_host", "hinted_from_disk",
            "hints_received", "hints_late", "hints_duplicate", "loads_started", "evictions",
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
    hint_lead_s: float | None = None  # from the driver's hint for this request to its arrival, as sent


@dataclass
class RunRecord:
    requests: list[RequestTrace]
    metrics: dict  # engine counters over this run only (differences of engine.metrics())
    wall_s: float
    load_s: list[float] = field(default_factory=list)  # each load's start to its slot being ready
    unused_resident_bytes: int = 0  # loaded during the run, never used, still resident at its end


def vocab_ids(tokenizer) -> np.ndarray:
    """Token ids a random prompt may use: the whole vocab except special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(len(tokenizer)) if i not in special])


def run_trace(engine: LLMEngine, arrivals: Sequence[Arrival], adapter_names: Sequence[str],
              prompts: Sequence[list[int]], hint_lead_s: float = 0.0,
              on_finish: Callable[[], None] | None = None, idle_poll_s: float = 0.0) -> RunRecord:
    """Play `arrivals` against `engine` in real time; return per-request timings and the run's counters."""
    assert not engine.has_work(), "the engine must be idle before a run"
    return _Player(engine, arrivals, adapter_names, prompts, hint_lead_s, on_finish, idle_poll_s).play()


class _Player:
    def __init__(self, engine, arrivals, adapter_names, prompts, hint_lead_s, on_finish, idle_poll_s):
        self.engine, self.arrivals, self.names, self.prompts = engine, arrivals, adapter_names, prompts
        self.hint_lead_s, self.on_finish, self.idle_poll_s = hint_lead_s, on_finish, idle_poll_s
        self.traces = [RequestTrace(a.t_s, a.adapter, a.prompt_len, a.output_len) for a in arrivals]
        self.next_add = self.next_hint = 0
        self.hinted_at: dict[int, float] = {}  # request index -> when its hint was sent
        self.start = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start

    def play(self) -> RunRecord:
        engine, before = self.engine, self.engine.metrics()
        self.start = time.perf_counter()
        while self.next_add < len(self.arrivals) or engine.has_work():
            self._send_hints()
            self._add_arrivals()
            only_loading = not engine.waiting and not engine.running
            if engine.has_work() and not (only_loading and self.idle_poll_s > 0):
                self._record(engine.step())
            else:
                self._idle()
        return RunRecord(self.traces, metrics_delta(before, engine.metrics()), self.now())

    def _send_hints(self) -> None:
        if self.hint_lead_s <= 0:
            return
        while self.next_hint < len(self.arrivals) and self.arrivals[self.next_hint].t_s - self.hint_lead_s <= self.now():
            adapter = self.arrivals[self.next_hint].adapter
            if adapter is not None:
                self.engine.hint([Hint(self.names[adapter])])
                self.hinted_at[self.next_hint] = self.now()
            self.next_hint += 1

    def _add_arrivals(self) -> None:
        engine, counters = self.engine, self.engine.residency.metrics
        while self.next_add < len(self.arrivals) and self.arrivals[self.next_add].t_s <= self.now():
            i = self.next_add
            a, trace = self.arrivals[i], self.traces[i]
            trace.arrived_to_queue = bool(engine.waiting)
            if i in self.hinted_at:
                trace.hint_lead_s = self.now() - self.hinted_at.pop(i)
            kinds = (counters.hint_hits, counters.inflight_hits, counters.misses)
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(self.prompts[i], None if a.adapter is None else self.names[a.adapter], params,
                               request_id=f"r{i}")
            after = (counters.hint_hits, counters.inflight_hits, counters.misses)
            trace.arrival_kind = next((k for k, x, y in zip(("hit", "inflight", "miss"), kinds, after) if x != y), None)
            self.next_add += 1

    def _record(self, outputs) -> None:
        stamp = self.now()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            trace = self.traces[int(output.request_id[1:])]
            trace.token_s += [stamp] * len(output.token_ids)
            if output.finished:
                trace.finished_s = stamp
                if self.on_finish:
                    self.on_finish()

    def _idle(self) -> None:
        """Nothing to run: sleep until the next hint or arrival, polling in-flight loads every idle_poll_s."""
        due = [self.arrivals[self.next_add].t_s] if self.next_add < len(self.arrivals) else []
        if self.hint_lead_s > 0 and self.next_hint < len(self.arrivals):
            due.append(self.arrivals[self.next_hint].t_s - self.hint_lead_s)
        wait = min(due) - self.now() if due else 0.0
        if self.engine.has_work():  # only loads are in flight
            self._record(self.engine.step())
            wait = min(wait, self.idle_poll_s) if due else self.idle_poll_s
        time.sleep(max(0.0, wait))


def metrics_delta(before: dict, after: dict) -> dict:
    """What happened between two engine.metrics() snapshots (all residency counters are cumulative)."""
    out = {k: after[k] - before[k] for k in COUNTERS}
    for name in HISTOGRAMS:
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
