"""Which base-model linear layers a LoRA adapter may target, and their shapes."""

from __future__ import annotations

from transformers import PretrainedConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


def module_path(layer: int, target: str) -> str:
    """Path of a target inside a Llama-architecture CausalLM, as PEFT names it after its prefix."""
    block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    return f"model.layers.{layer}.{block}.{target}"


def target_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) for every supported target of the base model."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    per_target = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return {
        module_path(layer, target): per_target[target]
        for layer in range(config.num_hidden_layers)
        for target in SUPPORTED_TARGETS
    }
