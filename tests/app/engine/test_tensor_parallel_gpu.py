"""A replica's engine sharded over 2 and 4 GPUs (NCCL, bf16, CUDA graphs captured with the all-reduces inside)
serves PEFT's bf16 output, with steps one at a time and overlapped, under the tolerance of the one-GPU bf16 fidelity
test (tests/app/engine/test_fidelity.py): greedy tokens equal up to near ties, prompt logits within BF16_ATOL, for the
base and three adapters of ranks 4, 8 and 16; with `quantization: fp8`, PEFT's over the FP8 base as the ranks compute
it. The model is the graph tests' (head_dim 64, which the Triton decode kernel and so the graphs take; 4 heads and 2
KV heads, replicated at 4 GPUs)."""

import pytest
import torch

from engine_helpers import agrees_up_to_near_tie, assert_bf16_fidelity, greedy, run_all
from fp8_helpers import fp8_peft_reference

MAX_NEW = 16
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.timeout(240)  # a collective that never pairs up hangs: fail with the stacks instead
@pytest.mark.parametrize("overlap", [False, True], ids=["one-at-a-time", "overlapped"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_bf16_engine_serves_peft_s_output(make_engine, graph_model, manifest, size, overlap):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    adapters = {f"a{i}": f"adapters/a{i}" for i in range(3)}
    engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                         adapter_roots=(str(graph_model / "adapters"),), num_slots=4, tensor_parallel_size=size,
                         overlap_steps=overlap)
    assert engine.runner.graph_batches  # decode steps replay graphs, all-reduces inside
    for name, path in adapters.items():
        engine.register_adapter(name, str(graph_model / path))
    assert_bf16_fidelity(engine, graph_model, manifest["prompts"][0], adapters, MAX_NEW)  # make_engine shuts it down


@pytest.mark.timeout(240)
def test_a_sharded_fp8_engine_serves_the_fp8_arithmetic_of_its_ranks(make_engine, graph_model, manifest):
    """quantization: fp8 at 2 GPUs: each rank quantizes its shard as it loads, and the greedy tokens of the base and
    an adapter equal PEFT's over the FP8 base as two ranks compute it (each row-parallel projection's ranks quantize
    their input columns on their own), up to near ties."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an FP8 GPU")
    engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                         quantization="fp8", adapter_roots=(str(graph_model / "adapters"),), num_slots=4,
                         tensor_parallel_size=2)
    engine.register_adapter("a2", str(graph_model / "adapters" / "a2"))
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)], (None, "a2")[i % 2]) for i in range(4)]
    requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
    tokens = run_all(engine, check=True)
    for (prompt, adapter), request in zip(jobs, requests):
        expected, scores = fp8_peft_reference(graph_model, adapter, prompt, MAX_NEW, ranks=2)
        assert agrees_up_to_near_tie(tokens[request.request_id], expected, scores), (adapter, prompt)
