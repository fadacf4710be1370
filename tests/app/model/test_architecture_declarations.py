"""The architecture declarations against transformers' own models (target paths and shapes, and the features its
modules compute), and check_supported's refusals, each naming the model_type, why, and what is served."""

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from app.adapters.targets import TARGET_NAMES, target_shapes
from app.model.architectures import ARCHITECTURES, MODEL_TYPE_TO_ARCHITECTURE, UnsupportedModel, check_supported
from app.model.lora import LoRASlots
from arch_helpers import CASES, case_config, tiny_config
from prefetch.layout import PageLayout

ONE_CASE_PER_MODEL_TYPE = {model_type: name for name, (model_type, _) in reversed(CASES.items())}


def test_every_declared_model_type_has_a_fidelity_case():
    assert set(ONE_CASE_PER_MODEL_TYPE) == set(MODEL_TYPE_TO_ARCHITECTURE)
    assert set(TARGET_NAMES) == {name for arch in ARCHITECTURES for name in arch.target_names}


def built(name):
    torch.manual_seed(0)
    config = case_config(name)
    return config, AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name", sorted(set(ONE_CASE_PER_MODEL_TYPE.values())))
def test_declared_targets_are_the_models_linears(name):
    config, model = built(name)
    shapes = target_shapes(config)
    assert len(shapes) == config.num_hidden_layers * len(check_supported(config).targets)
    for path, (in_features, out_features) in shapes.items():
        linear = model.get_submodule(path)
        assert type(linear) is nn.Linear, path
        assert (linear.in_features, linear.out_features) == (in_features, out_features), path


@pytest.mark.parametrize("name", sorted(set(ONE_CASE_PER_MODEL_TYPE.values())) + ["llama-biases"])
def test_declared_features_are_what_transformers_computes(name):
    config, model = built(name)
    arch = check_supported(config)
    attention = model.get_submodule(arch.layers)[0].self_attn
    first = getattr(attention, arch.targets[0].name)
    has_bias = config.attention_bias if arch.qkv_bias is None else arch.qkv_bias
    assert (first.bias is not None) == has_bias
    assert (hasattr(attention, "q_norm") and hasattr(attention, "k_norm")) == arch.qk_norm

    norm = model.get_submodule(arch.layers)[0].input_layernorm
    with torch.no_grad():
        norm.weight.zero_()
        zero_weight_output = norm(torch.randn(2, config.hidden_size)).abs().max().item()
    assert (zero_weight_output > 0) == (arch.norm == "x*(1+w)")

    seen = {}

    def first_layer_input(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]

    model.get_submodule(arch.layers)[0].register_forward_pre_hook(first_layer_input, with_kwargs=True)
    ids = torch.tensor([[5, 17, 300]])
    with torch.no_grad():
        model(input_ids=ids)
        plain = model.get_input_embeddings().weight[ids]
    scale = math.sqrt(config.hidden_size) if arch.scaled_embeddings else 1.0
    torch.testing.assert_close(seen["hidden"], plain * scale)


@pytest.mark.parametrize("model_type, overrides, phrase", [
    ("mixtral", {}, "mixture-of-experts"),
    ("qwen2_moe", {}, "mixture-of-experts"),
    ("qwen3_moe", {}, "mixture-of-experts"),
    ("gemma3", {}, "vision tower"),
    ("gpt2", {}, "no architecture is declared"),
    ("llama", dict(sliding_window=8), "Llama is not declared to use"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    ("llama", dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}), "quantized"),
    ("mistral", dict(sliding_window=0), "sliding_window=0"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
    ("gemma2", dict(attn_logit_softcapping=0.0), "attn_logit_softcapping=0.0"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "bidirectional"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "Gemma 3 is not declared to use"),
])
def test_refused_by_name_with_the_reason(model_type, overrides, phrase):
    with pytest.raises(UnsupportedModel, match=phrase) as refused:
        check_supported(tiny_config(model_type, **overrides))
    message = str(refused.value)
    assert f"model_type {model_type!r}" in message
    assert "Served model types: gemma, gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3" in message


def test_longrope_is_refused():
    half = tiny_config("phi3").head_dim // 2
    config = tiny_config("phi3", original_max_position_embeddings=128, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half})
    with pytest.raises(UnsupportedModel, match="RoPE type 'longrope'"):
        check_supported(config)


def test_windows_per_layer_follow_the_config():
    assert check_supported(case_config("mistral-window")).windows(case_config("mistral-window")) == [5, 5]
    assert check_supported(case_config("mistral")).windows(case_config("mistral")) == [None, None]
    qwen2 = case_config("qwen2-window")  # max_window_layers=1: the layers from 1 on slide
    assert check_supported(qwen2).windows(qwen2) == [None, 6]
    gemma2 = case_config("gemma2")
    assert check_supported(gemma2).windows(gemma2) == [6, None]
    assert check_supported(gemma2).attention_softcap(gemma2) == 1.0
    assert check_supported(gemma2).logit_softcap(gemma2) == 2.0


class QuantizedLikeLinear(nn.Linear):
    """Stands for any linear whose forward is not F.linear over its weight."""


def test_lora_refuses_a_target_that_is_not_a_plain_linear():
    config, model = built("llama")
    attention = model.model.layers[1].self_attn
    attention.v_proj = QuantizedLikeLinear(attention.v_proj.in_features, attention.v_proj.out_features, bias=False)
    layout = PageLayout(target_shapes(config), max_rank=8)
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.1\.self_attn\.v_proj is QuantizedLikeLinear"):
        LoRASlots(model, layout, num_pages=2 * layout.max_pages, num_slots=2, t_cap=8)
