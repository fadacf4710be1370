"""Prometheus metrics through ray.serve.metrics. Created on first use, inside a Ray worker."""

from __future__ import annotations

from functools import cache

from ray.serve import metrics

LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
STALL_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


@cache
def requests():
    return metrics.Counter("lora_requests", "HTTP requests by route and status.", tag_keys=("route", "status"))


@cache
def ttft():
    return metrics.Histogram("lora_ttft_seconds", "Time to first token.", boundaries=LATENCY_S, tag_keys=("model",))


@cache
def itl():
    return metrics.Histogram("lora_itl_seconds", "Inter-token latency.", boundaries=LATENCY_S, tag_keys=("model",))


@cache
def placements():
    return metrics.Counter("lora_router_placements", "Router decisions: affinity, spread, cold, base, "
                           "fallback (default routing), hint (sent to a replica), hint_deferred (held back: the "
                           "replica's hint room was full).", tag_keys=("outcome",))


@cache
def residency():
    return metrics.Counter("lora_adapter_arrivals", "Requests by adapter residency on arrival at a replica: "
                           "hit (resident), inflight (loading), miss.", tag_keys=("kind",))


@cache
def hinted_arrivals():
    return metrics.Counter("lora_hinted_arrivals", "Requests the router hinted while they waited, on arrival at "
                           "their replica, by where their adapter was: device (a slot), host (the host cache, or "
                           "read into it), disk (nowhere: the hint did not help).", tag_keys=("tier",))


@cache
def stalls():
    return metrics.Histogram("lora_stall_seconds", "Time the engine waited with nothing runnable.",
                             boundaries=STALL_S)


@cache
def slots():
    return metrics.Gauge("lora_slots", "Device adapter slots by state.", tag_keys=("state",))
