"""The claim through Serve without Ray: a trace as request bodies, the replicas' counters over a run, the
summary, and the deployment arguments the bench builds (the run itself: test_serve_claim.py)."""

from __future__ import annotations

import numpy as np

from bench.engine.driver import COUNTERS, metrics_delta
from bench.serve.arms import SERVE_ARMS, RequestResult, request_bodies, sum_deltas, summarize
from bench.serve.cluster import app_args_for, replica_overrides
from bench.serve.load import parse_args
from bench.workloads import Arrival, make

NAMES = [f"bench-{i:04d}" for i in range(8)]


def test_trace_becomes_streaming_bodies_with_its_lengths():
    arrivals = make("uniform", 8, 20, rate=10.0, seed=3, length_scale=0.1)
    vocab = np.arange(100, 200)
    bodies = request_bodies(arrivals, NAMES, "base", vocab, seed=3)
    assert bodies == request_bodies(arrivals, NAMES, "base", vocab, seed=3)  # every arm sends the same
    for a, body in zip(arrivals, bodies):
        assert body["model"] == NAMES[a.adapter] and body["max_tokens"] == a.output_len
        assert len(body["prompt"]) == a.prompt_len and set(body["prompt"]) <= set(vocab.tolist())
        assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0
    assert request_bodies([Arrival(0.0, None, 3, 2)], NAMES, "base", vocab, 0)[0]["model"] == "base"


def snapshot(scale: int, stall_s: float = 0.0, lead_s: float = 0.0, wait_s: float = 0.0) -> dict:
    """An engine.metrics() snapshot with every counter at `scale` (only what metrics_delta reads)."""
    histogram = lambda total: {"count": scale, "sum": total, "buckets": {"le_0.1": scale, "le_inf": 0}}  # noqa: E731
    return {**{k: scale for k in COUNTERS}, "steps": 10 * scale, "stall_seconds": histogram(stall_s),
            "hint_lead_seconds": histogram(lead_s), "adapter_wait_seconds": histogram(wait_s),
            "adapter_wait_before_load_seconds": histogram(wait_s / 2), "first_token_seconds": histogram(wait_s * 2),
            "request_seconds": histogram(wait_s * 4),
            "tiers": {"disk_to_host": {"bytes": 1000 * scale, "seconds": 0.5 * scale, "reads": scale, "cache_hits": 0},
                      "host_to_device": {"bytes": 2000 * scale, "seconds": 1e-6 * scale}}}


def test_counters_are_differences_summed_over_replicas():
    first = metrics_delta(snapshot(1), snapshot(3, stall_s=0.2, lead_s=0.1, wait_s=0.4))  # 2 of everything
    second = metrics_delta(snapshot(0), snapshot(5, stall_s=0.3, lead_s=0.5, wait_s=0.3))  # 5 of everything
    total = sum_deltas([first, second])
    assert all(total[k] == 7 for k in COUNTERS) and total["steps"] == 70
    assert total["stall_seconds"]["count"] == 7 and abs(total["stall_seconds"]["sum"] - 0.5) < 1e-9
    assert total["hint_lead_seconds"]["buckets"] == {"le_0.1": 7, "le_inf": 0}
    assert total["adapter_wait_seconds"]["count"] == 7 and abs(total["adapter_wait_seconds"]["sum"] - 0.7) < 1e-9
    assert total["tiers"]["disk_to_host"]["reads"] == 7 and total["tiers"]["host_to_device"]["bytes"] == 14000
    assert abs(total["tiers"]["host_to_device"]["gb_per_s"] - 14000 / 7e-6 / 1e9) < 1e-6


def test_summary_rates_and_latencies():
    results = [RequestResult("a", 0.0, 0.001, True, 200, 0.1, 0.5, [0.1, 0.2, 0.5], 3, "r1"),
               RequestResult("a", 0.5, 0.501, True, 200, 0.7, 1.0, [0.7, 1.0], 2, "r1"),
               RequestResult("b", 1.0, 1.002, True, 200, 1.3, 2.0, [1.3, 2.0], 2, "r2"),
               RequestResult("b", 1.5, 1.5, False, 429)]
    delta = {**{k: 0 for k in COUNTERS}, "hint_hits": 2, "inflight_hits": 1, "misses": 1, "hints_received": 3,
             "steps": 5, "stall_seconds": {"count": 2, "sum": 0.4, "buckets": {}},
             "hint_lead_seconds": {"count": 3, "sum": 0.3, "buckets": {}},
             "adapter_wait_seconds": {"count": 4, "sum": 0.2, "buckets": {}},
             "adapter_wait_before_load_seconds": {"count": 4, "sum": 0.1, "buckets": {}},
             "first_token_seconds": {"count": 3, "sum": 0.6, "buckets": {}},
             "request_seconds": {"count": 3, "sum": 1.5, "buckets": {}},
             "tiers": {"disk_to_host": {}, "host_to_device": {"gb_per_s": None}}}
    s = summarize(results, delta, {}, hints_pushed=4, samples=[(5, 3), (2, 2), (1, 4)])
    assert s["requests"] == 4 and s["completed"] == 3 and s["statuses"] == {"200": 3, "429": 1}
    assert abs(s["ttft_s"]["p50"] - 0.2) < 1e-9  # from the scheduled arrival: 0.1, 0.2, 0.3
    assert abs(s["request_throughput_per_s"] - 3 / 2.0) < 1e-9 and abs(s["token_throughput_per_s"] - 7 / 2.0) < 1e-9
    assert s["hint_hit_rate"] == 0.75 and s["hint_hit_rate_when_queued"] is None  # no hinted arrival
    delta.update(hinted_on_device=3, hinted_in_host=1)
    s = summarize(results, delta, {}, hints_pushed=4, samples=[(5, 3), (2, 2), (1, 4)])
    assert s["hint_hit_rate_when_queued"] == 0.75 and s["hinted_arrivals"] == {"device": 3, "host": 1, "disk": 0}
    assert abs(s["stall_s_per_request"] - 0.1) < 1e-9 and abs(s["hint_lead_s_mean"] - 0.1) < 1e-9
    assert abs(s["adapter_wait_s_mean"] - 0.05) < 1e-9 and abs(s["adapter_wait_before_load_s_mean"] - 0.025) < 1e-9
    assert abs(s["replica_first_token_s_mean"] - 0.2) < 1e-9 and abs(s["replica_request_s_mean"] - 0.5) < 1e-9
    assert s["router_wait"] == {"samples": 3, "mean": 2 / 3, "max": 2, "share_of_samples_waiting": 1 / 3}
    assert s["requests_per_replica"] == {"r1": 2, "r2": 1} and s["replicas_per_adapter_mean"] == 1.0


def test_arms_differ_only_in_router_and_hints():
    assert {a: (arm.router, arm.hints) for a, arm in SERVE_ARMS.items()} == {
        "A": ("adapter_affinity", True), "A0": ("adapter_affinity", False), "serve_default": ("serve_default", False)}


def test_app_args_bytes_and_gpu_share(tmp_path):
    args = parse_args(["--launch", "--arms", "A", "--rate", "5", "--batch", "32", "--max-ongoing", "32",
                       "--gpus-per-replica", "0.5", "--app-args",
                       '{"kv_cache_bytes": 1024, "host_cache_bytes": 4096, "num_slots": 3}'])
    app = app_args_for(args, tmp_path, tmp_path, {"adapter_memory_bytes": 1 << 20, "host_cache_bytes": 2048,
                                                  **SERVE_ARMS["A"].app_args()})
    assert (app.num_slots, app.adapter_memory_bytes) == (3, None)  # --app-args wins, and drops the other
    assert (app.kv_cache_bytes, app.host_cache_bytes, app.max_ongoing_requests, app.hints) == (1024, 4096, 32, True)
    overrides = replica_overrides(args, app, 2)
    assert overrides["num_replicas"] == 2 and overrides["ray_actor_options"]["num_gpus"] == 0.5
    assert "num_cpus" in overrides["ray_actor_options"] and "runtime_env" in overrides["ray_actor_options"]
