"""The offline throughput bench on the tiny demo: every request finishes with exactly its max_tokens,
the JSON records what it claims, and a time budget flags the result as partial."""

from __future__ import annotations

import json

from bench.engine import throughput
from bench.engine.offline_workload import make_workload, warm_up


def run(demo_dir, tmp_path, *extra):
    out = tmp_path / "result.json"
    throughput.main(["--size", "tiny", "--demo-dir", str(demo_dir), "--requests", "8", "--max-len", "32",
                           "--adapters", "4", "--slots", "4", "--max-batch-size", "4", "--out", str(out), *extra])
    return json.loads(out.read_text())


def test_workload_is_seeded_and_in_range():
    names = ["a", "b", "c"]
    work = make_workload(50, names, 32, vocab=1000, seed=3)
    assert work == make_workload(50, names, 32, vocab=1000, seed=3)
    assert all(8 <= len(p) < 32 for p in work.prompts) and all(8 <= n < 32 for n in work.max_tokens)
    assert set(work.adapters) <= set(names)


def test_base_workload_sends_every_request_to_the_base_model():
    base = make_workload(20, [], 32, vocab=1000, seed=3)
    assert base == make_workload(20, [], 32, vocab=1000, seed=3)
    assert base.adapters == [None] * 20 and base.summary()["distinct_adapters"] == 0
    assert all(8 <= len(p) < 32 for p in base.prompts) and all(8 <= n < 32 for n in base.max_tokens)


def test_warm_up_serves_every_adapter_once_or_the_base_model():
    work = make_workload(4, ["a", "b", "c"], 32, vocab=1000, seed=0)
    assert warm_up(work, ["a", "b", "c"]).adapters == ["a", "b", "c"]
    base = warm_up(work, [])
    assert base.adapters == [None] and base.prompts == [work.prompts[0][:8]] and base.max_tokens == [2]


def test_engine_run_finishes_every_request(demo_dir, tmp_path):
    record = run(demo_dir, tmp_path)
    result = record["result"]
    assert not result["partial"]
    assert result["requests_finished"] == result["requests_total"] == 8
    assert result["output_tokens"] == result["finished_output_tokens"] == record["workload"]["output_tokens"]
    assert result["length_mismatches"] == 0
    assert result["steps"] == result["prefill_steps"] + result["decode_steps"]
    assert result["output_tokens_per_s"] > 0
    assert record["engine_config"]["max_batch_size"] == 4
    assert {"command", "git_commit", "device", "torch", "transformers"} <= set(record)


def test_base_model_run_without_adapters(demo_dir, tmp_path):
    record = run(demo_dir, tmp_path, "--adapters", "0")
    assert record["result"]["requests_finished"] == 8 and record["workload"]["distinct_adapters"] == 0


def test_peft_baseline_counts_only_each_requests_tokens(demo_dir, tmp_path):
    record = run(demo_dir, tmp_path, "--engine", "peft")
    result = record["result"]
    assert result["requests_finished"] == 8 and result["batches"] == 2
    assert result["output_tokens"] == record["workload"]["output_tokens"]


def test_time_budget_flags_partial(demo_dir, tmp_path):
    result = run(demo_dir, tmp_path, "--time-budget-s", "0")["result"]
    assert result["partial"] and result["requests_finished"] < result["requests_total"]
