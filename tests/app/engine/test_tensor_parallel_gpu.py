"""A replica's engine sharded over 2 and 4 GPUs (NCCL, bf16, CUDA graphs captured with the all-reduces inside)
serves PEFT's bf16 output, with steps one at a time and overlapped, under the tolerance of the one-GPU bf16 fidelity
test (tests/app/engine/test_fidelity.py): greedy tokens equal up to near ties, prompt logits within BF16_ATOL, for the
base and three adapters of ranks 4, 8 and 16. The model is the graph tests' (head_dim 64, which the Triton decode
kernel and so the graphs take; 4 heads and 2 KV heads, replicated at 4 GPUs)."""

import pytest
import torch

from engine_helpers import assert_bf16_fidelity

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
