"""The claim through Serve end to end on the tiny demo (CPU, a local Ray cluster): arms A and A0 each on a
fresh 2-replica deployment at the same adapter memory, a trace heavy enough that requests wait in the
router, and only A's router sending hints."""

from __future__ import annotations

import json

import ray
from ray import serve

from bench.ports import free_ports
from bench.serve import load as serve_load


def test_arms_a_and_a0_through_serve(demo_dir, tmp_path):
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    [port] = free_ports(1)
    try:
        [path] = serve_load.main([
            "--launch", "--size", "tiny", "--demo-dir", str(demo_dir), "--arms", "A", "A0", "--workload", "uniform@4",
            "--num-requests", "16", "--rate", "40", "--capacity", "2", "--batch", "2", "--max-ongoing", "1",
            "--length-scale", "0.05", "--drain-s", "0.5", "--port", str(port), "--results-dir", str(tmp_path)])
    finally:
        serve.shutdown()
        ray.shutdown()
    assert path.name == "cpu-serve-claim-uniform.json"
    result = json.loads(path.read_text())
    assert result["complete"] and set(result["results"]) == {"A", "A0"} and result["host_cache_warmed"]
    memory = {r["adapter_memory_bytes"] for pools in result["pool"].values() for r in pools.values()}
    assert memory == {2 * result["max_rank_adapter_bytes"]}  # M is the same on every replica of every arm
    a, a0 = result["results"]["A"], result["results"]["A0"]
    for summary in (a, a0):
        assert summary["completed"] == summary["requests"] == 16
        assert sum(summary["arrival_kinds"].values()) == 16  # the warm-ups are not counted
        assert summary["tiers"]["disk_to_host"]["reads"] == 0  # every adapter was in the host caches
    # Both replicas hold every adapter here, so a request hinted to one may still be served by the other first:
    # how many arrivals consume their hint is timing. Each one that does is counted once, with its lead.
    assert a["hints_received"] > 0
    assert a["hint_lead_histogram"]["count"] == sum(a["hinted_arrivals"].values())
    assert a0["hints_received"] == a0["hints_pushed"] == 0


def test_the_engine_loop_a_launch_runs_is_recorded():
    """engine_process null (the app's default) is a process on CUDA and a thread on CPU; the results say which."""
    import torch

    from bench.serve.cluster import engine_loop

    assert engine_loop('{"engine_process": true}') == "process" and engine_loop('{"engine_process": false}') == "thread"
    assert engine_loop("{}") == ("process" if torch.cuda.is_available() else "thread")
    assert engine_loop('{"device": "cuda"}') == "process" and engine_loop('{"device": "cpu"}') == "thread"
