"""The claim benchmark end to end on the tiny demo (CPU): every arm runs at the same adapter memory M and
host cache, D only where the N adapters fit, and every reported metric is in the JSON."""

from __future__ import annotations

import json

from app.engine.config import EngineConfig
from app.sampling.params import SamplingParams
from bench.adapter_pool import prepare
from bench.engine import hints
from bench.engine.arms import ARMS, build_engine, close_engine, reset_residency, use_arm

METRICS = {"ttft_s", "itl_s", "e2e_s", "request_throughput_per_s", "token_throughput_per_s", "stall_s_per_request",
           "hint_hit_rate", "hint_hit_rate_when_queued", "arrivals_when_queued", "hint_lead_s", "hint_lead_samples_s",
           "load_s", "wasted_prefetch_bytes", "wasted_prefetch_bytes_evicted", "unused_resident_bytes_at_end",
           "adapter_memory_bytes", "host_cache_bytes", "tiers", "ttft_samples_s"}
COMMON = ["--size", "tiny", "--capacity", "2", "--rate", "8", "--duration-s", "1.0", "--length-scale", "0.02"]


def test_claim_bench_quick_end_to_end(demo_dir, tmp_path):
    paths = hints.main([*COMMON, "--demo-dir", str(demo_dir), "--n-values", "1", "2", "8",
                               "--workload", "uniform", "sequential", "--sequential-requests", "12",
                               "--results-dir", str(tmp_path)])
    assert [p.name for p in paths] == ["cpu-claim-uniform.json", "cpu-claim-sequential.json"]
    uniform, sequential = (json.loads(p.read_text()) for p in paths)
    m = uniform["adapter_memory_bytes"]
    pool = uniform["pool"]
    assert m == 2 * pool["max_rank_adapter_bytes"] == pool["pages"] * pool["page_nbytes"]
    assert uniform["variant"] == "warm-host" and uniform["host_cached_at_start"] == 50  # sequential's N = 50
    assert set(uniform["arms"]) == {"B", "A0", "A", "D"}
    assert {a: (c["prefetch"], c["hints"]) for a, c in uniform["arms"].items()} == {
        "B": (False, False), "A0": (True, False), "A": (True, True), "D": (False, False)}
    assert {c["adapter_memory_bytes"] for c in uniform["arms"].values()} == {m}
    held = uniform["adapters_m_holds"]
    assert held >= 2  # the demo's ranks (4, 8, 16) let M hold more than K max-rank adapters
    for n, arms in uniform["results"].items():
        assert set(arms) == ({"B", "A0", "A", "D"} if int(n) <= held else {"B", "A0", "A"}), n
        for arm, summary in arms.items():
            assert METRICS <= set(summary), (n, arm, METRICS - set(summary))
            assert summary["completed"] == summary["requests"] == 8
            assert summary["adapter_memory_bytes"] == m and summary["host_cache_bytes"] == uniform["host_cache_bytes"]
            assert summary["tiers"]["disk_to_host"]["reads"] == 0  # the host cache was filled before the clock
            assert (summary["hint_lead_s"]["count"] > 0) == (arm == "A")
    assert uniform["results"]["8"]["B"]["stalls"] > 0  # B's misses block the engine: synchronous loads
    assert set(sequential["results"]) == {"50"} and set(sequential["results"]["50"]) == {"B", "A0", "A"}
    assert sequential["results"]["50"]["A"]["requests"] == 12
    assert sorted(p.name for p in tmp_path.glob("*uniform*.png")) == [
        "cpu-claim-uniform-hint-lead.png", "cpu-claim-uniform-ttft-cdf.png", "cpu-claim-uniform-ttft-vs-n.png"]


def test_disk_variant_reads_from_disk(demo_dir, tmp_path):
    [path] = hints.main([*COMMON, "--demo-dir", str(demo_dir), "--n-values", "8", "--workload", "uniform",
                                "--arms", "B", "A", "--host-cache-adapters", "1", "--cold-disk", "--no-plots",
                                "--results-dir", str(tmp_path)])
    assert path.name == "cpu-claim-uniform-disk.json"
    result = json.loads(path.read_text())
    assert result["variant"] == "disk" and result["cold_disk"] and result["host_cached_at_start"] == 0
    assert result["host_cache_bytes"] == result["pool"]["max_rank_adapter_bytes"]
    for summary in result["results"]["8"].values():
        assert summary["tiers"]["disk_to_host"]["reads"] > 0


def test_arm_switch_changes_the_loading_policy(demo_dir):
    """One engine serves every arm: with B's setting a miss loads inside the step that admits it."""
    base, adapter_dir, names = prepare("tiny", 2, demo_dir=demo_dir)
    engine = build_engine(EngineConfig(base_model=str(base), adapter_roots=(str(adapter_dir),), num_slots=2),
                          None, True, names, adapter_dir)
    try:
        for arm in ("A0", "B"):
            reset_residency(engine, names)
            use_arm(engine, ARMS[arm])
            assert engine.config.prefetch is ARMS[arm].prefetch
        stalls = engine.residency.metrics.stalls.count
        engine.add_request([8, 9, 10], names[1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), "r")
        outputs = engine.step()
        assert len(engine.running) == 1 and not engine.residency.is_loading()  # loaded, then prefilled
        assert engine.residency.metrics.stalls.count == stalls + 1  # the load, timed as a stall
        outputs += engine.step()  # overlapped steps stream a step's token at the next
        assert len(outputs[0].token_ids) == 1
    finally:
        close_engine(engine)
