"""A replica's engine sharded over 2 and 4 GPUs (NCCL, bf16, CUDA graphs captured with the all-reduces inside)
serves PEFT's bf16 output, under the tolerance of the one-GPU bf16 fidelity test (tests/app/engine/test_fidelity.py):
greedy tokens equal up to near ties, prompt logits within BF16_ATOL, for the base and every demo adapter."""

import pytest
import torch

from engine_helpers import assert_bf16_fidelity

MAX_NEW = 16
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("size", [2, 4])
def test_a_sharded_bf16_engine_serves_peft_s_output(make_engine, demo_dir, manifest, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    engine = make_engine(num_slots=8, device="cuda", dtype="bfloat16", tensor_parallel_size=size)
    assert engine.runner.graph_batches  # decode steps replay graphs, all-reduces inside
    assert_bf16_fidelity(engine, demo_dir, manifest, MAX_NEW)  # make_engine shuts it down, process group and all
