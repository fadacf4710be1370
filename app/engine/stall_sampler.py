"""Where the engine thread is when its host work runs long: a sampling profiler for the engine process.

The engine thread marks which part of its loop it is in (a step's admission, its work before the launch, its
work after the sync, or the gap between steps); the GPU wait and an idle engine are unmarked. A daemon thread
wakes every `interval_s`, and while the engine thread has been in one marked part for longer than `threshold_s`,
it counts the engine thread's innermost frames, and the innermost frame of each other thread of the process
that is not parked in a wait (a thread that runs Python, or sits in a system call, at that moment).

A step's host part that runs long while the engine thread's own CPU time does not (step_timing's
host_cpu_seconds) waited for the GIL or in a system call; the counts say where it waited, and which other
threads were busy then. The sampler's own lateness in waking (`wake_late_ms`) is what any thread of the
process waits for the GIL when it wants it back, over the whole run.

Written by hand: py-spy and the like sample from outside the process and need ptrace, which containers often
forbid, and they do not know the engine's parts.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter, deque

# Innermost functions of threads that are parked (a pool's idle worker, a queue's reader, a poll loop).
_PARKED = {("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"), ("queue.py", "get"),
           ("selectors.py", "select"), ("connection.py", "_recv"), ("connection.py", "_poll"),
           ("thread.py", "_worker"), ("base_events.py", "_run_once")}


def _where(frame, depth: int) -> str:
    """The innermost `depth` frames as 'file:line function' from the innermost out, joined by ' < '."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


class StallSampler:
    def __init__(self, interval_s: float = 0.005, threshold_s: float = 0.02, depth: int = 4):
        self.interval_s, self.threshold_s, self.depth = interval_s, threshold_s, depth
        self._part: tuple[str, float] | None = None  # written by the engine thread only
        self._engine_thread: int | None = None
        self.samples: Counter[str] = Counter()  # part -> samples taken while it ran long
        self.engine: Counter[str] = Counter()  # (part, engine thread's innermost frames) -> samples
        self.others: Counter[str] = Counter()  # another thread's innermost frame -> samples
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._late: deque[float] = deque(maxlen=4096)  # seconds each recent wake-up came after it was due
        self.late_total = [0, 0.0, 0.0]  # wake-ups, their lateness in seconds, the largest

    def mark(self, part: str | None) -> None:
        """Engine thread: it enters `part` ("admit", "before", "after", "between"), or None (GPU wait, idle)."""
        if self._thread is None:
            self._engine_thread = threading.get_ident()
            self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)
            self._thread.start()
        self._part = None if part is None else (part, time.perf_counter())

    def stop(self) -> None:
        self._stopped.set()

    def summary(self, top: int = 12) -> dict:
        late = sorted(self._late)
        quantile = lambda q: round(1e3 * late[min(len(late) - 1, int(q * len(late)))], 3) if late else 0.0  # noqa: E731
        wakes, late_s, worst = self.late_total
        return {"interval_ms": self.interval_s * 1e3, "threshold_ms": self.threshold_s * 1e3,
                "samples": dict(self.samples), "engine": self.engine.most_common(top),
                "others": self.others.most_common(top),
                "wake_late_ms": {"recent_p50": quantile(0.5), "recent_p99": quantile(0.99), "wakes": wakes,
                                 "mean": round(1e3 * late_s / wakes, 3) if wakes else 0.0,
                                 "max": round(1e3 * worst, 3)}}

    def _run(self) -> None:
        me = threading.get_ident()
        due = time.perf_counter() + self.interval_s
        while not self._stopped.wait(max(0.0, due - time.perf_counter())):
            now = time.perf_counter()
            late = max(0.0, now - due)
            self._late.append(late)
            self.late_total[0] += 1
            self.late_total[1] += late
            self.late_total[2] = max(self.late_total[2], late)
            due = now + self.interval_s
            marked = self._part
            if marked is None or now - marked[1] < self.threshold_s:
                continue
            part = marked[0]
            frames = sys._current_frames()
            engine = frames.get(self._engine_thread)
            if engine is None:
                continue
            self.samples[part] += 1
            self.engine[f"{part}: {_where(engine, self.depth)}"] += 1
            for ident, frame in frames.items():
                if ident in (me, self._engine_thread):
                    continue
                code = frame.f_code
                if (code.co_filename.rsplit("/", 1)[-1], code.co_name) not in _PARKED:
                    self.others[_where(frame, 2)] += 1
