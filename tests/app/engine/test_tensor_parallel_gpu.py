"""A replica's engine sharded over 2 and 4 GPUs (NCCL, bf16, CUDA graphs captured with the all-reduces inside)
serves PEFT's bf16 output, under the tolerance of the one-GPU bf16 fidelity test (tests/app/engine/test_fidelity.py):
greedy tokens equal up to near ties, prompt logits within BF16_ATOL, for the base and every demo adapter."""

import pytest
import torch

from engine_helpers import BF16_ATOL, agrees_up_to_near_tie, bf16_reference, greedy, run_all

MAX_NEW = 16
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_bf16_engine_serves_peft_s_output(make_engine, demo_dir, manifest, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    engine = make_engine(num_slots=8, device="cuda", dtype="bfloat16", tensor_parallel_size=size)
    try:
        assert engine.runner.graph_batches  # decode steps replay graphs, all-reduces inside
        prompt = manifest["prompts"][0]
        for adapter in [None] + manifest["adapters"]:
            name, path = (None, None) if adapter is None else (adapter["name"], adapter["path"])
            tokens, scores, logits = bf16_reference(demo_dir, path, prompt, MAX_NEW)
            request = engine.add_request(prompt, name, greedy(MAX_NEW))
            got = run_all(engine, check=True)[request.request_id]
            assert agrees_up_to_near_tie(got, tokens, scores), (name, got, tokens)
            assert (engine.prompt_logits(prompt, name) - logits).abs().max().item() <= BF16_ATOL, name
    finally:
        engine.shutdown()  # the process group goes with it: the next size starts its own
