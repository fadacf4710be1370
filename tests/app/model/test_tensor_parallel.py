"""Tensor parallelism on CPU: how each projection and adapter is sharded, the sizes refused by name, a worker that
reads only its shard from a checkpoint, and two workers in a real gloo process group whose sharded forward, with an
adapter on every target, gives the unsharded model's logits (the adapter row: PEFT's) within float32's
summation-order error, in the model's dtype and with FP8 weights."""

import copy
import json

import pytest
import torch
import torch.multiprocessing as mp

from app.model.architectures import UnsupportedModel, check_supported
from app.model.tensor_parallel import (RowParallelLinear, ShardPlan, TensorParallel, check_tensor_parallel, load_shard,
                                       shard_model)
from arch_helpers import case_config
from tp_helpers import build, save_checkpoints, worker

# case -> (architecture case, config overrides, how): q/k/v and MLP biases (the row-parallel down_proj's bias is
# added once), Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 2's soft-capping and windows, Phi-3's fused projections,
# and one key/value head replicated over both ranks; `how` the workers get their shards (tp_helpers.logits_errors):
# shard the whole model, read them from a saved checkpoint, shard and quantize them to FP8, or read them from an FP8
# checkpoint (compressed-tensors' format); the FP8 ones' reference is the FP8 arithmetic of two ranks in one process.
CASES = {
    "llama-biases": ("llama-biases", dict(mlp_bias=True), "checkpoint"),
    "llama-one-kv-head": ("llama", dict(num_key_value_heads=1), "checkpoint"),
    "qwen2": ("qwen2", {}, "shard"),
    "qwen3": ("qwen3", {}, "shard"),
    "gemma2": ("gemma2", {}, "shard"),
    "phi3": ("phi3", {}, "checkpoint"),
    "llama-biases-fp8": ("llama-biases", dict(mlp_bias=True), "fp8"),
    "phi3-fp8": ("phi3", {}, "fp8"),
    "llama-biases-fp8-checkpoint": ("llama-biases", dict(mlp_bias=True), "fp8-checkpoint"),
    "phi3-fp8-checkpoint": ("phi3", {}, "fp8-checkpoint"),
}


def plans(config, size):
    arch = check_supported(config)
    return arch, [ShardPlan(arch, config, TensorParallel(rank, size)) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_heads_and_columns_and_together_they_hold_everything(size):
    config = case_config("phi3", num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=64)
    arch, ranks = plans(config, size)
    for path, (n_in, n_out) in arch.target_shapes(config).items():
        held = torch.cat([plan.splits[path].index for plan in ranks]).bincount()
        split = ranks[0].splits[path]
        width = n_out if split.kind == "column" else n_in
        assert len(held) == width, path
        if path.endswith("qkv_proj") and size == 4:  # 2 KV heads over 4 ranks: each KV row on two ranks
            q = 8 * 8
            assert held[:q].eq(1).all() and held[q:].eq(2).all()
        else:
            assert held.eq(1).all(), path
        for plan in ranks:
            local = len(plan.splits[path].index)
            assert plan.local_shape(path) == ((n_in, local) if split.kind == "column" else (local, n_out))
    o_proj = "model.layers.0.self_attn.o_proj"
    assert ranks[1].splits[o_proj].kind == "row" and ranks[1].local_shape(o_proj) == (64 // size, 64)


def test_an_adapter_is_sharded_as_its_linears():
    config = case_config("llama")
    arch, (plan, _) = plans(config, 2)
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    q_a, q_b = plan.shard_adapter("model.layers.0.self_attn.q_proj", a, b)
    assert torch.equal(q_a, a) and torch.equal(q_b, b[:32])  # column-parallel: A whole, its rows of B
    o_a, o_b = plan.shard_adapter("model.layers.0.self_attn.o_proj", a, b)
    assert torch.equal(o_a, a[:, :32]) and torch.equal(o_b, b)  # row-parallel: its columns of A, B whole


@pytest.mark.parametrize("heads, kv_heads, inter, size, named", [
    (6, 2, 128, 4, "the 6 attention heads"),
    (6, 3, 128, 2, "the 3 key/value heads"),
    (4, 2, 130, 4, "intermediate_size 130"),
])
def test_a_size_that_cannot_shard_the_model_is_refused_by_name(heads, kv_heads, inter, size, named):
    config = case_config("llama", num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads,
                         intermediate_size=inter)
    with pytest.raises(UnsupportedModel, match=f"tensor_parallel_size {size} does not divide .*{named}"):
        check_tensor_parallel(config, size)


@pytest.mark.parametrize("case", ["llama-biases", "llama-one-kv-head", "phi3"])
def test_a_worker_reads_only_its_shard_and_holds_what_sharding_the_whole_model_gives(case, tmp_path):
    name, overrides, _ = CASES[case]
    model, _, _, arch = build(name, overrides)
    model.save_pretrained(tmp_path)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        loaded, plan = load_shard(tmp_path, copy.deepcopy(model.config), arch, tp, torch.float32, torch.device("cpu"))
        whole = copy.deepcopy(model)
        shard_model(whole, arch, tp)
        expected = whole.state_dict()
        assert loaded.state_dict().keys() == expected.keys()
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, expected[key]), key
        row = plan.splits["model.layers.1.mlp.down_proj"]
        assert row.kind == "row" and isinstance(loaded.get_submodule("model.layers.1.mlp.down_proj"), RowParallelLinear)
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim"):
            assert getattr(loaded.config, field) == getattr(whole.config, field), field


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    cases = [(case, *spec) for case, spec in CASES.items()]
    save_checkpoints(cases, str(folder / "result"))
    mp.spawn(worker, args=(2, str(folder / "init"), cases, str(folder / "result")), nprocs=2, join=True)
    return [json.loads((folder / f"result.{rank}").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_workers_give_the_unsharded_logits_and_peft_s_adapter_row(two_workers, case):
    for rank, results in enumerate(two_workers):
        errors = results[case]
        assert errors["local_heads"] == 2
        assert errors["adapter_effect"] > 0.05  # the adapter changes the logits, so matching PEFT's row means it
        assert errors["base"] < 1e-4 and errors["adapter"] < 1e-4, (rank, errors)
