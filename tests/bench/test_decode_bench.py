"""The decode bench's model shapes, built on the meta device (no GPU, no memory): transformers' own config and model
classes give the published models' parameter counts and features, and each head size is one the Triton decode
kernel takes, so every shape decodes through the engine's CUDA graphs."""

from __future__ import annotations

import argparse

import pytest
import torch

from app.model.kernels import attention as attention_kernels
from app.model.softcap import install_logit_softcap
from bench.engine import decode

PUBLISHED_PARAMETERS = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "qwen2.5-7b": 7_615_616_512,
                        "gemma-2-9b": 9_241_705_984}


@pytest.mark.parametrize("shape", list(decode.SHAPES))
def test_dry_run_counts_the_published_weights(shape):
    [line] = decode.main(["--shape", shape, "--dry-run", "--batches", "1", "32"])
    assert line["shape"] == shape and line["weights_gb"] == round(2 * PUBLISHED_PARAMETERS[shape] / 1e9, 2)
    assert line["head_dim"] in attention_kernels.HEAD_DIMS
    assert line["layers"] == decode.SHAPES[shape][2]["num_hidden_layers"]  # --layers defaults to the shape's
    per_token = line["layers"] * 2 * line["kv_heads"] * line["head_dim"] * 2  # no window is passed at 513 tokens
    assert line["kv_read_gb"] == {1: round(513 * per_token / 1e9, 3), 32: round(32 * 513 * per_token / 1e9, 3)}


def test_llama_is_the_default_shape_as_the_bench_always_built_it():
    [line] = decode.main(["--dry-run"])
    assert line["shape"] == "llama-3-8b" and line["weights_gb"] == 16.06 and line["head_dim"] == 128
    assert not line["tied_embeddings"] and line["window"] is None and line["attn_softcap"] is None


def test_gemma_2_9b_has_its_features():
    [line] = decode.main(["--shape", "gemma-2-9b", "--dry-run"])
    assert line["head_dim"] == 256 and line["tied_embeddings"]  # lm_head reads the embedding: counted once
    assert (line["windowed_layers"], line["window"], line["window_passed"]) == (21, 4096, False)
    assert (line["attn_softcap"], line["final_softcap"]) == (50.0, 30.0)
    [long] = decode.main(["--shape", "gemma-2-9b", "--dry-run", "--context", "8000", "--batches", "1"])
    per_token_and_layer = 2 * 8 * 256 * 2  # K and V, 8 heads of 256, bf16
    # 21 full layers read all 8001 tokens, 21 sliding ones the last 4096
    assert long["window_passed"] and long["kv_read_gb"][1] == round(per_token_and_layer * 21 * (8001 + 4096) / 1e9, 3)
    args = argparse.Namespace(shape="gemma-2-9b", layers=2, context=512)
    config, model = decode.build_model(args, torch.device("meta"))
    attention = model.model.layers[0].self_attn
    assert config.layer_types == ["sliding_attention", "full_attention"] and attention.scaling == 256 ** -0.5
    assert config.hidden_activation == "gelu_pytorch_tanh"
    install_logit_softcap(model, config.final_logit_softcapping)  # as the model runner does, before the run's floor
    assert decode.describe(config, model, args)["tied_embeddings"]


def test_qwen_2_5_7b_has_biases_and_no_window():
    config, model = decode.build_model(argparse.Namespace(shape="qwen2.5-7b", layers=None), torch.device("meta"))
    attention = model.model.layers[0].self_attn
    assert all(getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj"))
    assert attention.o_proj.bias is None and config.sliding_window is None and len(model.model.layers) == 28
    assert config.rope_parameters["rope_theta"] == 1e6


def test_a_tensor_parallel_rank_of_llama_3_70b_holds_its_shards_and_the_replicated_rest():
    from app.model.tensor_parallel import RowParallelLinear
    from bench.engine import tp_decode

    args = argparse.Namespace(shape="llama-3-70b", layers=None, tp=4)
    config, model = tp_decode.random_shard(args, 3, torch.device("meta"))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attention.q_proj.out_features, attention.k_proj.out_features) == (64 // 4 * 128, 8 // 4 * 128)
    assert isinstance(attention.o_proj, RowParallelLinear) and attention.o_proj.in_features == 2048
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.in_features == 28672 // 4
    replicated = 2 * 128256 * 8192 + (2 * 80 + 1) * 8192  # embeddings, lm_head and the norms
    assert decode.weight_bytes(model) == 2 * ((70_553_706_496 - replicated) // 4 + replicated)  # 38.4 GB a GPU


def test_the_bench_sequences_are_what_the_step_inputs_read():
    """The bench drives the model runner with its own sequences: StepInputs reads them as the engine's requests."""
    from app.engine.scheduler import Chunk, StepPlan
    from app.engine.step_inputs import StepInputs

    seq = decode.Seq("d0", [5, 6, 7], slot=2)
    seq.num_cached, seq.output_ids = 3, [9]
    inputs = StepInputs.of(StepPlan(decode=[Chunk(seq, 3, 1)]), {"d0": [4]}, block_size=16)
    assert (inputs.input_ids, inputs.positions, inputs.token_slots, inputs.pending) == ([9], [3], [2], [])
    assert inputs.slot_mapping == [4 * 16 + 3] and inputs.decode_lens == [4]
