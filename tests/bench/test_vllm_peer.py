"""bench.peers.vllm without vLLM: its LLM(...) keywords, its message when vLLM is missing, and a whole run against
a stand-in `vllm` module that records what it was sent, on the tiny demo; then the comparison table."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field

import pytest

from bench.engine.offline_workload import make_workload, warm_up
from bench.peers import compare
from bench.peers import vllm as peer


@dataclass
class FakeLLM:
    """vllm.LLM's offline surface: every request runs to its max_tokens."""

    kwargs: dict
    calls: list = field(default_factory=list)

    def generate(self, prompts, sampling_params, *, use_tqdm=True, lora_request=None):
        self.calls.append((prompts, sampling_params, lora_request))
        return [types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(token_ids=[7] * p.max_tokens)])
                for p in sampling_params]


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # main sets it; undone after the test
    made = []
    module = types.ModuleType("vllm")
    module.__version__ = "0.0-test"
    module.LLM = lambda **kwargs: made.append(FakeLLM(kwargs)) or made[-1]
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda **kwargs: types.SimpleNamespace(**kwargs)
    for name, mod in {"vllm": module, "vllm.inputs": inputs, "vllm.lora": types.ModuleType("vllm.lora"),
                      "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return made


def args_for(*extra):
    return peer.parse_args(["--size", "tiny", "--requests", "8", "--max-len", "32", "--slots", "4", *extra])


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(SystemExit, match="install.sh"):
        peer.require_vllm()


def test_engine_args_map_ours_flags_and_take_more(tmp_path):
    base = peer.engine_args(args_for("--max-batch-size", "128"), tmp_path, tmp_path, [])
    assert base == {"model": str(tmp_path), "dtype": "auto", "seed": 0, "max_num_seqs": 128,
                    "gpu_memory_utilization": 0.85}
    extra = peer.engine_args(args_for("--engine-arg", "enforce_eager=true", "--engine-arg", "max_model_len=2048",
                                      "--engine-arg", "kv_cache_dtype=fp8"), tmp_path, tmp_path, [])
    assert extra["enforce_eager"] is True and extra["max_model_len"] == 2048 and extra["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        peer.parse_engine_args(["enforce_eager"])


def test_run_sends_the_workload_of_ours(demo_dir, tmp_path, fake_vllm):
    record = peer.main(["--size", "tiny", "--demo-dir", str(demo_dir), "--requests", "8", "--max-len", "32",
                        "--adapters", "4", "--slots", "4", "--max-batch-size", "4", "--out-dir", str(tmp_path),
                        "--name", "throughput-vllm-test"])
    (llm,) = fake_vllm
    assert llm.kwargs["max_num_seqs"] == 4 and llm.kwargs["enable_lora"] is True
    assert llm.kwargs["max_loras"] == 4 and llm.kwargs["max_cpu_loras"] == 4 and llm.kwargs["max_lora_rank"] == 16
    (warm_prompts, _, warm_loras), (prompts, params, loras) = llm.calls
    vocab = json.loads((demo_dir / "base" / "config.json").read_text())["vocab_size"]
    names = [f"bench-{i:04d}" for i in range(4)]
    work = make_workload(8, names, 32, vocab, seed=0)
    assert [p["prompt_token_ids"] for p in warm_prompts] == warm_up(work, names).prompts
    assert [r.lora_name for r in warm_loras] == names
    assert [p["prompt_token_ids"] for p in prompts] == work.prompts
    assert [p.max_tokens for p in params] == work.max_tokens
    assert all(p.ignore_eos and p.temperature == 0 for p in params)
    assert [r.lora_name for r in loras] == work.adapters and all(r.lora_int_id >= 1 for r in loras)
    saved = json.loads(next(tmp_path.glob("*-throughput-vllm-test.json")).read_text())
    assert saved["engine"] == "vllm" and saved["vllm_version"] == "0.0-test" and saved["engine_args"] == llm.kwargs
    assert saved["result"]["output_tokens"] == saved["workload"]["output_tokens"] == sum(work.max_tokens)
    assert saved["result"]["requests_finished"] == 8 and saved["result"]["length_mismatches"] == 0
    assert record["args"]["max_batch_size"] == 4


def test_base_run_sends_no_lora(demo_dir, tmp_path, fake_vllm):
    peer.main(["--size", "tiny", "--demo-dir", str(demo_dir), "--requests", "4", "--max-len", "16", "--adapters", "0",
               "--out-dir", str(tmp_path)])
    (llm,) = fake_vllm
    assert "enable_lora" not in llm.kwargs
    assert [len(prompts) for prompts, _, _ in llm.calls] == [1, 4]
    assert all(loras is None for _, _, loras in llm.calls)


def result(tmp_path, engine, concurrency, adapters, tok_s, timestamp="2026-01-01T00:00:00Z", device="NVIDIA H200"):
    path = tmp_path / f"{engine}-{concurrency}-{adapters}-{timestamp[:4]}.json"
    path.write_text(json.dumps({"benchmark": "throughput", "engine": engine, "timestamp": timestamp,
                                "device": device, "git_commit": "abc1234",
                                "args": {"max_batch_size": concurrency, "adapters": adapters},
                                "result": {"output_tokens_per_s": tok_s, "partial": False}}))
    return path


def test_compare_pairs_engines_by_concurrency_and_adapters(tmp_path):
    paths = [result(tmp_path, "ours", 32, 0, 2000.0), result(tmp_path, "vllm", 32, 0, 4000.0),
             result(tmp_path, "vllm", 32, 0, 3000.0, "2027-01-01T00:00:00Z"),  # the latest counts
             result(tmp_path, "ours", 32, 32, 1500.0)]
    rows = compare.rows(paths)
    assert [(r.max_concurrent, r.adapters, r.ours_tok_s, r.vllm_tok_s) for r in rows] == [
        (32, 0, 2000.0, 3000.0), (32, 32, 1500.0, None)]
    assert rows[0].ratio == pytest.approx(2 / 3) and rows[1].ratio is None
    assert "| 32 | base | 2,000 | 3,000 | 0.67 |" in compare.markdown(rows)


def test_the_table_names_the_device_and_commit_its_results_share(tmp_path):
    paths = [result(tmp_path, "ours", 32, 0, 2000.0), result(tmp_path, "vllm", 32, 0, 3000.0)]
    written = json.loads(next(iter(_summaries(tmp_path, paths))).read_text())
    assert (written["device"], written["git_commit"]) == ("NVIDIA H200", "abc1234")
    mixed = [*paths, result(tmp_path, "ours", 32, 32, 1500.0, device="NVIDIA H100 80GB HBM3")]
    written = json.loads(next(iter(_summaries(tmp_path / "mixed", mixed))).read_text())
    assert written["device"] != "NVIDIA H200" and written["git_commit"] == "abc1234"  # this machine's name


def _summaries(out_dir, paths):
    compare.main([*map(str, paths), "--out-dir", str(out_dir)])
    return out_dir.glob("*throughput-vs-vllm.json")
