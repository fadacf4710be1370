"""An engine sharded over two workers (tensor_parallel_size 2, gloo on CPU, float32) serves PEFT's own output:
greedy tokens of the base and two adapters in one mixed batch equal PeftModel.generate, with overlapped steps
(each worker takes its pending inputs from rank 0's sampled tokens), and prompt logits agree within 1e-4, for
Llama (with q/k/v and MLP biases) and Phi-3 (fused projections); Qwen2 is served so through Serve
(tests/deploy/test_served_architectures.py). Sizes that cannot shard the model are refused at start-up, by name,
before any worker starts. A worker that dies fails the next step by name (503 for the requests in flight) and ends
the engine loop, so the replica's health check fails."""

import asyncio
from pathlib import Path

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.errors import EngineUnavailable
from app.model.architectures import UnsupportedModel
from arch_helpers import build_case, peft_references
from engine_helpers import engine_config, greedy, run_all

MAX_NEW = 12
PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps", "Once upon a time"]


def test_a_lost_worker_fails_the_requests_in_flight_and_ends_the_engine_loop(demo_dir):
    engine = AsyncEngine(LLMEngine(engine_config(demo_dir, tensor_parallel_size=2)))
    try:
        worker = engine.engine.runner.workers.processes[0].popen
        worker.kill()
        worker.wait()

        async def ask():
            async for output in engine.generate("Once upon a time", None, greedy(4)):
                return output

        with pytest.raises(EngineUnavailable, match="tensor-parallel-worker-1 ended"):  # a 503 for the client
            asyncio.run(ask())
        engine._thread.join(timeout=10)
        assert not engine.is_alive()  # the replica's health check fails, and Serve replaces it
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=[("llama-biases", dict(mlp_bias=True)), ("phi3", {})],
                ids=lambda param: param[0])
def served(request, tmp_path_factory, demo_dir):
    """The case's PEFT references, and an engine over two workers with its adapters registered."""
    name, overrides = request.param
    root = tmp_path_factory.mktemp(name)
    info = build_case(root, name, Path(demo_dir) / "base", **overrides)
    references = peft_references(root, info["adapters"], PROMPTS, MAX_NEW)
    engine = LLMEngine(engine_config(root, num_slots=4, tensor_parallel_size=2, max_prefill_tokens_per_step=8,
                                     overlap_steps=True))  # the workers' pending inputs come from rank 0's tokens
    for adapter in info["adapters"]:
        engine.register_adapter(adapter, str(root / "adapters" / adapter))
    yield engine, references
    engine.shutdown()


def test_two_workers_serve_peft_s_greedy_tokens_in_one_mixed_batch(served):
    engine, references = served
    keys = {engine.add_request(prompt, adapter, greedy(MAX_NEW)).request_id: (adapter, prompt)
            for adapter, prompt in references}
    tokens = run_all(engine, check=True)
    for request_id, key in keys.items():
        assert tokens[request_id] == references[key][0], key
    assert engine.overlapped_steps > 0


def test_two_workers_give_peft_s_prompt_logits_within_1e_4(served):
    engine, references = served
    for (adapter, prompt), (_, expected) in references.items():
        got = engine.prompt_logits(prompt, adapter)
        assert (got - expected).abs().max().item() <= 1e-4, (adapter, prompt)


@pytest.mark.parametrize("overrides, named", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide the 4 attention heads"),
])
def test_a_size_or_setting_it_cannot_serve_is_refused_before_any_worker_starts(demo_dir, overrides, named):
    with pytest.raises(UnsupportedModel, match=named):
        LLMEngine(engine_config(demo_dir, **overrides))

