"""Where an engine step's time goes on the host, for the metrics endpoint and the benches.

Each step ends with one device->host copy of the sampled tokens, so the GPU idles while the host
schedules, prepares and launches the next step, and while it turns the tokens into outputs
(detokenizing, stop strings). `before_ms + after_ms` per step is therefore the time the host makes
the GPU wait; `wait_ms` is the host waiting on the GPU (the step's device time, roughly). Two more
parts of the engine thread's time keep the GPU idle too: `admit_ms`, a step's start before it
schedules (finished loads, prefetches and fetches ahead for what is wanted next), and `between_ms`,
the thread's time from one step's end to the next one's start while requests are in the engine
(delivering outputs, commands such as hints and new requests). `totals["work"]` splits the engine
thread's time outside steps by what it did (each command by name, and "deliver"), with the thread's CPU
seconds beside the wall seconds: wall time well above CPU time is time the thread waited (for the GIL, or
for a file system call).

The percentiles cover the last WINDOW steps of each kind; `totals` count every step since the start,
so that a bench can take their difference over a run. Beside each kind's `host_seconds` (admission,
scheduling and launch, and the work after the sync), `host_cpu_seconds` is the engine thread's CPU time
over the same parts, and `totals["gc"]` the process's garbage collections per generation, with their
seconds: host time that is neither the thread's own work nor the collector's is time it waited to run
again (for the GIL held by another thread, or in a system call).
"""

from __future__ import annotations

import gc
import time
from collections import deque

from app.engine.stall_sampler import StallSampler

WINDOW = 512  # recent steps kept for the percentiles (the summary is sent to the router every poll)
PERCENTILES_EVERY_S = 0.5


class GcClock:
    """Every garbage collection in the process (through gc.callbacks): how many of each generation, and their
    seconds. A collection holds the GIL throughout, so it stops the engine thread wherever it runs."""

    def __init__(self):
        self.counts, self.seconds = [0, 0, 0], [0.0, 0.0, 0.0]
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started
            self._started = None

    def totals(self) -> dict:
        return {f"gen{g}": {"count": self.counts[g], "seconds": self.seconds[g]} for g in range(3)}


_GC_CLOCK: GcClock | None = None


def gc_clock() -> GcClock:
    """The process's one GcClock, installed on first use."""
    global _GC_CLOCK
    if _GC_CLOCK is None:
        _GC_CLOCK = GcClock()
        gc.callbacks.append(_GC_CLOCK)
    return _GC_CLOCK


def _percentiles(values: list[float], *qs: float) -> list[float]:
    """The q-quantiles of `values` (nearest rank below), sorting them once; 0.0 each where there are none."""
    if not values:
        return [0.0] * len(qs)
    ordered = sorted(values)
    return [round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) for q in qs]


class StepTiming:
    def __init__(self, window: int = WINDOW, sampler: StallSampler | None = None):
        self.sampler = sampler  # where the engine thread is when a host part runs long (None: not sampled)
        # (admit, before, wait, after) seconds of each recent step
        self.decode: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.mixed: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self.gaps: deque[float] = deque(maxlen=window)
        self.totals = {kind: {"steps": 0, "seconds": 0.0, "host_seconds": 0.0, "host_cpu_seconds": 0.0, "rows": 0}
                       for kind in ("decode", "mixed")}
        self._gc = gc_clock()
        self.totals["between"] = {"gaps": 0, "seconds": 0.0, "cpu_seconds": 0.0}
        self.totals["work"] = {}
        self._percentiles: tuple[float, dict] | None = None  # (when, the recent steps' percentiles then)

    def observe(self, admit_s: float, before_s: float, wait_s: float, after_s: float, decode_only: bool,
                rows: int, host_cpu_s: float = 0.0) -> None:
        """One step: its parts' seconds, `rows`, the requests it sampled a token for, and the engine thread's CPU
        seconds over the host parts."""
        kind = "decode" if decode_only else "mixed"
        (self.decode if decode_only else self.mixed).append((admit_s, before_s, wait_s, after_s))
        totals = self.totals[kind]
        totals["steps"] += 1
        totals["seconds"] += admit_s + before_s + wait_s + after_s
        totals["host_seconds"] += admit_s + before_s + after_s
        totals["host_cpu_seconds"] += host_cpu_s
        totals["rows"] += rows

    def mark(self, part: str | None) -> None:
        """Engine thread: it enters a host part of its loop ("admit", "before", "after", "between"), or leaves
        them (None: the GPU wait, or idle)."""
        if self.sampler is not None:
            self.sampler.mark(part)

    def between(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        """The engine thread's time from one step's end to the next one's start, requests waiting throughout, and
        its CPU time in that gap."""
        self.gaps.append(seconds)
        between = self.totals["between"]
        between["gaps"] += 1
        between["seconds"] += seconds
        between["cpu_seconds"] += cpu_seconds

    def work(self, name: str, seconds: float, cpu_seconds: float) -> None:
        """One piece of the engine thread's work outside steps: a command (by name) or delivering outputs."""
        totals = self.totals["work"].get(name)
        if totals is None:
            totals = self.totals["work"][name] = {"count": 0, "seconds": 0.0, "cpu_seconds": 0.0, "max_ms": 0.0}
        totals["count"] += 1
        totals["seconds"] += seconds
        totals["cpu_seconds"] += cpu_seconds
        totals["max_ms"] = max(totals["max_ms"], round(seconds * 1e3, 3))

    def summary(self) -> dict:
        """The recent steps' percentiles (recomputed at most every PERCENTILES_EVERY_S: the router's polls ask for
        them many times a second, on the engine thread) and the running totals (always current)."""
        now = time.perf_counter()
        if self._percentiles is None or now - self._percentiles[0] >= PERCENTILES_EVERY_S:
            self._percentiles = (now, self._recent())
        out = dict(self._percentiles[1])
        out["totals"] = {kind: dict(values) for kind, values in self.totals.items() if kind != "work"}
        out["totals"]["work"] = {name: dict(values) for name, values in self.totals["work"].items()}
        out["totals"]["gc"] = self._gc.totals()
        return out

    def _recent(self) -> dict:
        out = {}
        for name, samples in (("decode", self.decode), ("mixed", self.mixed)):
            admit = [s[0] * 1e3 for s in samples]
            before = [s[1] * 1e3 for s in samples]
            wait = [s[2] * 1e3 for s in samples]
            after = [s[3] * 1e3 for s in samples]
            host = [b + a for b, a in zip(before, after)]
            total = [h + w for h, w in zip(host, wait)]
            host_p50, host_p99 = _percentiles(host, 0.5, 0.99)
            admit_p50, admit_p99 = _percentiles(admit, 0.5, 0.99)
            before_p50, before_p99 = _percentiles(before, 0.5, 0.99)
            after_p50, after_p99 = _percentiles(after, 0.5, 0.99)
            out[name] = {
                "steps": len(samples),
                "step_ms_p50": _percentiles(total, 0.5)[0],
                "host_ms_p50": host_p50,
                "host_ms_p99": host_p99,
                "before_launch_ms_p50": before_p50,
                "before_launch_ms_p99": before_p99,
                "gpu_wait_ms_p50": _percentiles(wait, 0.5)[0],
                "after_sync_ms_p50": after_p50,
                "after_sync_ms_p99": after_p99,
                "host_share": round(sum(host) / sum(total), 3) if total and sum(total) > 0 else 0.0,
                "admit_ms_p50": admit_p50,
                "admit_ms_p99": admit_p99,
            }
        gaps = [g * 1e3 for g in self.gaps]
        gaps_p50, gaps_p99 = _percentiles(gaps, 0.5, 0.99)
        out["between"] = {"gaps": len(gaps), "ms_p50": gaps_p50, "ms_p99": gaps_p99}
        if self.sampler is not None:
            out["stalls"] = self.sampler.summary()
        return out
