"""Where an engine step's time goes on the host, for the metrics endpoint and the benches.

Each step ends with one device->host copy of the sampled tokens, so the GPU idles while the host
schedules, prepares and launches the next step, and while it turns the tokens into outputs
(detokenizing, stop strings). `before_ms + after_ms` per step is therefore the time the host makes
the GPU wait; `wait_ms` is the host waiting on the GPU (the step's device time, roughly).
"""

from __future__ import annotations

from collections import deque

WINDOW = 512  # recent steps kept for the percentiles (the summary is sent to the router every poll)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StepTiming:
    def __init__(self, window: int = WINDOW):
        self.decode: deque[tuple[float, float, float]] = deque(maxlen=window)  # (before, wait, after) seconds
        self.mixed: deque[tuple[float, float, float]] = deque(maxlen=window)

    def observe(self, before_s: float, wait_s: float, after_s: float, decode_only: bool) -> None:
        (self.decode if decode_only else self.mixed).append((before_s, wait_s, after_s))

    def summary(self) -> dict:
        out = {}
        for name, samples in (("decode", self.decode), ("mixed", self.mixed)):
            before = [s[0] * 1e3 for s in samples]
            wait = [s[1] * 1e3 for s in samples]
            after = [s[2] * 1e3 for s in samples]
            host = [b + a for b, a in zip(before, after)]
            total = [h + w for h, w in zip(host, wait)]
            out[name] = {
                "steps": len(samples),
                "step_ms_p50": round(_percentile(total, 0.5), 3),
                "host_ms_p50": round(_percentile(host, 0.5), 3),
                "host_ms_p99": round(_percentile(host, 0.99), 3),
                "before_launch_ms_p50": round(_percentile(before, 0.5), 3),
                "gpu_wait_ms_p50": round(_percentile(wait, 0.5), 3),
                "after_sync_ms_p50": round(_percentile(after, 0.5), 3),
                "host_share": round(sum(host) / sum(total), 3) if total and sum(total) > 0 else 0.0,
            }
        return out
