"""Residency at scale on CPU: mixed ranks share the page pool at its byte budget, and hundreds of small
adapters churn through a small pool and a small host arena with every invariant holding and every token
equal to an engine that holds them all."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import greedy, run_all
from routing.wire import Hint

RANKS = (1, 2, 4, 6, 8, 12, 16)


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, demo_dir):
    """200 random adapters of mixed ranks and target sets, written as PEFT folders from a demo adapter's layout."""
    root = tmp_path_factory.mktemp("many")
    template = Path(demo_dir) / "adapters" / "robot"  # targets every module
    config = json.loads((template / "adapter_config.json").read_text())
    shapes = {k: v.shape for k, v in load_file(template / "adapter_model.safetensors").items()}
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    names = []
    for i in range(200):
        rank = rng.choice(RANKS)
        targets = config["target_modules"] if i % 2 else ["q_proj", "v_proj", "o_proj"]
        tensors = {}
        for key, shape in shapes.items():
            if not any(f".{t}." in key for t in targets):
                continue
            if "lora_A" in key:
                tensors[key] = torch.randn(rank, shape[1], generator=gen) / shape[1] ** 0.5
            else:
                tensors[key] = torch.randn(shape[0], rank, generator=gen) * 0.5
        name = f"gen-{i:03d}-r{rank}"
        folder = root / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({**config, "r": rank, "lora_alpha": 2 * rank,
                                                                "target_modules": targets}))
        save_file(tensors, folder / "adapter_model.safetensors")
        names.append(name)
    return root, names


def register(engine, root, names):
    for name in names:
        engine.register_adapter(name, str(root / name))
    return engine


def max_rank_bytes(engine):
    return engine.residency.layout.adapter_nbytes(16, engine.dtype)


def test_mixed_ranks_share_the_pool_at_its_budget(make_engine, manifest, adapter_names):
    """The bytes of two rank-16 slots hold five of the demo's rank-4 and rank-8 adapters at once, and each
    answers as it does in a padded slot."""
    ranks = {a["name"]: a["rank"] for a in manifest["adapters"]}
    small = [a for a in adapter_names if ranks[a] < 16][:5]
    probe = make_engine(register=False)
    budget = 2 * max_rank_bytes(probe)
    engine = make_engine(num_slots=None, adapter_memory_bytes=budget, max_inflight_loads=8)
    assert engine.residency.pool.num_pages * engine.residency.layout.page_nbytes(engine.dtype) == budget
    engine.hint([Hint(a) for a in small])
    while engine.has_work():
        engine.step()
    assert sorted(engine.routing_stats().resident) == sorted(small)
    assert engine.residency.pool.free_page_count() == 8 - sum(-(-ranks[a] // 4) for a in small)
    engine.check_invariants()
    padded = make_engine(num_slots=8)
    for name in small:
        prompt = manifest["prompts"][0]
        got = engine.add_request(prompt, name, greedy(6))
        want = padded.add_request(prompt, name, greedy(6))
        assert run_all(engine, check=True)[got.request_id] == run_all(padded)[want.request_id], name
    assert engine.metrics()["loads_started"] == 5, "nothing was evicted"


def test_hundreds_of_adapters_churn_through_a_small_pool(make_engine, many_adapters, manifest):
    """200 adapters through 5 max-rank adapters' worth of pages; the host arena holds 12 of them, or only one
    (every load's read then waits for the previous load's host pages)."""
    root, names = many_adapters
    unit = max_rank_bytes(make_engine(register=False))
    common = dict(register=False, adapter_roots=(str(root),), max_batch_size=8)
    engines = {"every": register(make_engine(num_slots=len(names), **common), root, names)}
    for host in (12, 1):
        engines[host] = register(make_engine(num_slots=None, adapter_memory_bytes=5 * unit,
                                             host_cache_bytes=host * unit, **common), root, names)
    jobs_rng = random.Random(3)
    jobs = [(jobs_rng.choice(manifest["prompts"]), jobs_rng.choice(names + [None]), 2 + jobs_rng.randrange(4))
            for _ in range(100)]
    outputs = {}
    for key, engine in engines.items():
        rng = random.Random(4)
        pending, index_of, tokens = list(range(len(jobs))), {}, {}
        while pending or engine.has_work():
            for _ in range(rng.randrange(6)):  # bursts of arrivals between steps
                if pending:
                    i = pending.pop(0)
                    prompt, adapter, n = jobs[i]
                    index_of[engine.add_request(prompt, adapter, greedy(n)).request_id] = i
            if pending and rng.random() < 0.3:
                engine.hint([Hint(a) for a in rng.sample(names, 3)])  # hints for requests that go elsewhere (each starts loads)
            for output in engine.step():
                assert output.error is None, output.error
                tokens.setdefault(index_of[output.request_id], []).extend(output.token_ids)
            if key != "every":
                engine.check_invariants()
        outputs[key] = tokens
    assert len(outputs["every"]) == len(jobs) and outputs[12] == outputs["every"] and outputs[1] == outputs["every"]
    for host in (12, 1):
        metrics = engines[host].metrics()
        assert metrics["evictions"] > 30 and metrics["tiers"]["disk_to_host"]["cache_evictions"] > 0
        assert metrics["host_cache_bytes"] <= metrics["host_arena_bytes"] <= host * unit
        assert metrics["slots_pinned"] == 0
        assert metrics["pages_free"] == metrics["pages_total"] - sum(s["pages"] for s in metrics["slots"])
