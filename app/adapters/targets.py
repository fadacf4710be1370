"""Which base-model linear layers a LoRA adapter may target, and their shapes, from the architecture declarations
(app/model/architectures.py)."""

from __future__ import annotations

from transformers import PretrainedConfig

from app.model.architectures import ARCHITECTURES, LLAMA, check_supported

# The Llama family's names, which most declared architectures share.
ATTENTION_TARGETS = tuple(t.name for t in LLAMA.targets if t.block == "self_attn")
MLP_TARGETS = tuple(t.name for t in LLAMA.targets if t.block == "mlp")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# Every declared architecture's names (Phi-3 adds its fused qkv_proj and gate_up_proj).
TARGET_NAMES = tuple(dict.fromkeys(name for arch in ARCHITECTURES for name in arch.target_names))


def target_names(config: PretrainedConfig) -> tuple[str, ...]:
    """The names adapters may target on this base model; UnsupportedModel if it is not served."""
    return check_supported(config).target_names


def target_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) for every target of the base model, as PEFT names the module
    after its prefix; UnsupportedModel if the model is not served."""
    return check_supported(config).target_shapes(config)


def pool_shapes(shapes: dict[str, tuple[int, int]], target_modules) -> dict[str, tuple[int, int]]:
    """The shapes of `shapes` whose module name is one of `target_modules`: those the adapter pool holds pages for."""
    return {module: shape for module, shape in shapes.items() if module.rsplit(".", 1)[1] in target_modules}
