"""Streaming, cancellation, unregistration and failures through the threaded AsyncEngine."""

import asyncio
import gc
import shutil

import pytest

from app.engine import step_timing
from app.engine.async_engine import AsyncEngine
from app.errors import AdapterInUse, AdapterLoadFailed, AdapterNotFound, InvalidRequest, PromptTooLong
from app.sampling.params import SamplingParams
from engine_helpers import greedy, run_all, tokens_alone


@pytest.fixture
def async_engine(make_engine):
    engines = []

    def make(**overrides):
        engine = AsyncEngine(make_engine(**overrides))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(engine, prompt, adapter, params):
    text, tokens, last = "", [], None
    async for output in engine.generate(prompt, adapter, params):
        text += output.text
        tokens += output.token_ids
        last = output
    return text, tokens, last


def test_stream_equals_sync_engine(async_engine, make_engine, manifest, adapter_names):
    prompt = manifest["prompts"][0]
    sync = make_engine()
    expected = tokens_alone(sync, prompt, adapter_names[:3] + [None])
    engine = async_engine()

    async def main():
        results = await asyncio.gather(*(collect(engine, prompt, a, greedy(12)) for a in expected))
        return dict(zip(expected, results))

    results = asyncio.run(main())
    for adapter, (text, tokens, last) in results.items():
        assert tokens == expected[adapter]
        assert last.finished and last.finish_reason in ("stop", "length")
        assert last.completion_tokens == len(tokens)
        assert text == sync.tokenizer.decode(tokens, skip_special_tokens=True)


def test_stream_interval_merges_later_outputs_and_changes_nothing_else(async_engine, manifest, adapter_names):
    prompt, adapter, params = manifest["prompts"][0], adapter_names[0], greedy(40, ignore_eos=True)
    engine = async_engine()

    async def outputs(interval_s):
        engine.stream_interval_s = interval_s
        loop, seen = asyncio.get_running_loop(), []
        async for output in engine.generate(prompt, adapter, params):
            seen.append((loop.time(), output))
        return seen

    async def main():
        return await outputs(0.0), await outputs(0.25)

    each, merged = asyncio.run(main())
    expected = [t for _, o in each for t in o.token_ids]
    assert len(expected) == 40 and [t for _, o in merged for t in o.token_ids] == expected
    assert "".join(o.text for _, o in merged) == "".join(o.text for _, o in each)
    assert len(merged[0][1].token_ids) == 1  # the first token goes out at once
    assert len(merged) < len(each) / 2 and merged[-1][1].finished
    gaps = [b - a for (a, _), (b, _) in zip(merged[1:], merged[2:])]  # not the last: a finish goes out at once
    assert all(gap >= 0.2 for gap in gaps[:-1]), gaps


def test_cancel_frees_row_and_pin_within_one_step(async_engine, adapter_names, manifest):
    engine = async_engine()

    async def main():
        stream = engine.generate(manifest["prompts"][0], adapter_names[0], greedy(200, ignore_eos=True))
        async for output in stream:
            if output.completion_tokens >= 3:
                break
        running = await engine.call(lambda e: (len(e.running), e.residency.pool.pinned_count()))
        await stream.aclose()  # the client went away
        await asyncio.sleep(0.05)
        after = await engine.call(lambda e: (len(e.running), e.residency.pool.pinned_count(), e.steps))
        await engine.call(lambda e: e.check_invariants())
        return running, after

    running, after = asyncio.run(main())
    assert running == (1, 1)
    assert after[:2] == (0, 0)


def test_first_token_bookkeeping_ends_with_every_request(async_engine, adapter_names, manifest):
    """The engine thread tracks requests whose first output is not out yet (it yields the GIL after delivering
    one): finished, cancelled-before-the-first-token and refused requests all leave that set."""
    engine = async_engine()

    async def main():
        done = [asyncio.create_task(collect(engine, manifest["prompts"][0], a, greedy(4))) for a in adapter_names[:2]]
        early = asyncio.create_task(collect(engine, manifest["prompts"][1], adapter_names[0], greedy(50)))
        await asyncio.sleep(0)  # submitted, then cancelled before (or right after) its first token
        early.cancel()
        with pytest.raises(AdapterNotFound):
            await collect(engine, "hi", "no-such-adapter", greedy(4))
        await asyncio.gather(*done)
        await asyncio.sleep(0.05)
        return await engine.call(lambda e: (set(engine._awaiting_first), len(e.requests)))

    assert asyncio.run(main()) == (set(), 0)


def test_validation_errors_raise_before_streaming(async_engine, manifest):
    engine = async_engine(max_input_tokens=8)

    async def first(prompt, adapter):
        async for _ in engine.generate(prompt, adapter, greedy(4)):
            break

    with pytest.raises(AdapterNotFound):
        asyncio.run(first("hi", "no-such-adapter"))
    with pytest.raises(PromptTooLong, match="limit is 8"):
        asyncio.run(first("a long prompt " * 10, None))
    with pytest.raises(InvalidRequest, match="empty"):
        asyncio.run(first([], None))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_unregister_refuses_while_in_use_then_succeeds(async_engine, adapter_names, manifest):
    engine = async_engine()
    adapter = adapter_names[0]

    async def main():
        stream = engine.generate(manifest["prompts"][0], adapter, greedy(50, ignore_eos=True))
        await stream.__anext__()
        with pytest.raises(AdapterInUse, match="1 running or queued"):
            await engine.call(lambda e: e.unregister_adapter(adapter))
        async for _ in stream:
            pass
        await engine.call(lambda e: e.unregister_adapter(adapter))
        with pytest.raises(AdapterNotFound):
            await collect(engine, "hi", adapter, greedy(2))
        await engine.call(lambda e: e.check_invariants())

    asyncio.run(main())


def test_adapter_deleted_after_registration_fails_alone(async_engine, make_engine, demo_dir, manifest, tmp_path):
    victim = tmp_path / "victim"
    shutil.copytree(f"{demo_dir}/{manifest['adapters'][0]['path']}", victim)
    engine = async_engine(adapter_roots=(str(tmp_path), f"{demo_dir}/adapters"))
    healthy = manifest["adapters"][1]["name"]

    async def main():
        await engine.call(lambda e: e.register_adapter("victim", str(victim)))
        shutil.rmtree(victim)
        bad = collect(engine, "hi", "victim", greedy(4))
        good = collect(engine, "hi", healthy, greedy(4))
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, AdapterLoadFailed) and "victim" in str(bad)
    assert good[2].finished and good[1]


def test_out_of_vocabulary_token_ids_are_refused_without_touching_others(make_engine, manifest):
    engine = make_engine()
    vocab = engine.model_config.vocab_size
    for ids in ([vocab], [-1], [1, "2"]):
        with pytest.raises(InvalidRequest, match="token ids"):
            engine.add_request(ids, None, greedy(2))
    with pytest.raises(InvalidRequest, match="tokenized"):
        engine.add_request("\ud800", None, greedy(2))
    request = engine.add_request(manifest["prompts"][0], None, greedy(3))
    assert len(run_all(engine, check=True)[request.request_id]) >= 1


def test_nan_written_after_registration_fails_that_adapter_at_load(make_engine, demo_dir, manifest, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    victim = tmp_path / "victim"
    shutil.copytree(f"{demo_dir}/{manifest['adapters'][1]['path']}", victim)
    engine = make_engine(register=False, adapter_roots=(str(tmp_path),))
    engine.register_adapter("victim", str(victim))
    tensors = load_file(victim / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = torch.full_like(tensors[key], float("nan"))  # same size: only the values change
    with safe_open(str(victim / "adapter_model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    save_file(tensors, victim / "adapter_model.safetensors", metadata=metadata)
    engine.add_request(manifest["prompts"][0], "victim", greedy(4))
    healthy = engine.add_request(manifest["prompts"][0], None, greedy(4))
    errors, tokens = [], {}
    while engine.has_work():
        for output in engine.step():
            if output.error is not None:
                errors.append(output.error)
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    assert len(errors) == 1 and isinstance(errors[0], AdapterLoadFailed) and "limit" in str(errors[0])
    assert len(tokens[healthy.request_id]) == 4
    engine.check_invariants()


def test_step_timing_counts_every_sampled_token_and_the_gaps_between_steps(async_engine, manifest, adapter_names):
    """Every token a request gets is one row of one step's totals, and the engine thread's time between steps
    with requests in the engine is counted apart from the steps; the stall sampler (on at a 0.01 ms threshold)
    names the loop's parts it found running."""
    engine = async_engine(sample_stalls_ms=0.01)
    prompts = manifest["prompts"][:2]

    async def main():
        return await asyncio.gather(*(collect(engine, p, a, greedy(10, ignore_eos=True))
                                      for p, a in zip(prompts, adapter_names[:2])))

    results = asyncio.run(main())
    timing = engine.engine.timing.summary()
    totals = timing["totals"]
    assert totals["decode"]["rows"] + totals["mixed"]["rows"] == sum(len(tokens) for _, tokens, _ in results) == 20
    assert totals["decode"]["steps"] + totals["mixed"]["steps"] >= 10
    for kind in ("decode", "mixed"):
        assert totals[kind]["seconds"] >= totals[kind]["host_seconds"] > 0
        assert 0 < totals[kind]["host_cpu_seconds"] <= totals[kind]["host_seconds"] * 1.5 + 0.01
        assert 0 <= timing[kind]["admit_ms_p50"] <= timing[kind]["admit_ms_p99"]
    assert totals["between"]["gaps"] >= 9 and totals["between"]["seconds"] > 0  # a request had a next step 9 times
    assert timing["between"]["gaps"] == totals["between"]["gaps"]
    assert 0 <= totals["between"]["cpu_seconds"] <= totals["between"]["seconds"] * 1.5 + 0.01
    work = totals["work"]
    assert work["add"]["count"] == 2 and work["deliver"]["count"] >= 10  # each request's add, each step's outputs
    assert all(w["seconds"] >= 0 and w["cpu_seconds"] >= 0 and w["max_ms"] >= 0 for w in work.values())
    assert set(totals["gc"]) == {"gen0", "gen1", "gen2"} and totals["gc"]["gen0"]["count"] >= 0
    assert set(timing["stalls"]["samples"]) <= {"admit", "before", "after", "between"}


def test_gc_clock_counts_collections_and_their_time():
    clock = step_timing.gc_clock()
    before = clock.totals()
    gc.collect()
    after = clock.totals()
    assert after["gen2"]["count"] == before["gen2"]["count"] + 1
    assert after["gen2"]["seconds"] > before["gen2"]["seconds"]


def test_stall_sampler_finds_where_a_long_host_part_waits():
    """A part that runs past the threshold is sampled where the engine thread is, with the busy thread beside it."""
    import threading
    import time

    from app.engine.stall_sampler import StallSampler

    sampler = StallSampler(interval_s=0.002, threshold_s=0.01)
    stop = threading.Event()

    def busy_neighbour():
        while not stop.is_set():
            sum(range(1000))

    def slow_launch():
        time.sleep(0.15)

    neighbour = threading.Thread(target=busy_neighbour)
    neighbour.start()
    try:
        sampler.mark("before")
        slow_launch()
        sampler.mark(None)
        time.sleep(0.05)  # unmarked: the GPU wait is not sampled
    finally:
        stop.set()
        neighbour.join()
        sampler.stop()
    summary = sampler.summary()
    assert set(summary["samples"]) == {"before"} and summary["samples"]["before"] >= 5
    assert summary["engine"][0][0].startswith("before: test_async_engine.py:") and "slow_launch" in summary["engine"][0][0]
    assert any("busy_neighbour" in where for where, _ in summary["others"])
    late = summary["wake_late_ms"]
    # every sample follows a wake (how many wakes a busy machine allows in 0.15 s is not this test's business)
    assert late["wakes"] >= summary["samples"]["before"]
    assert 0 <= late["recent_p50"] <= late["recent_p99"] <= late["max"]
