"""Adapters are checked against the targets the base's architecture declares: an adapter made for another
architecture's module names, or one on modules LoRA is not served for (embed_tokens, lm_head), is refused at
registration naming the module; an adapter on Phi-3's fused projections registers with their fused shapes."""

import pytest

from app.adapters.registry import AdapterRegistry
from app.errors import AdapterTargetUnsupported
from app.model.architectures import UnsupportedModel
from arch_helpers import case_config, save_adapter, save_base, tiny_config


@pytest.fixture
def bases(tmp_path, demo_dir):
    """Saved tiny Llama and Phi-3 bases of the same widths, and an adapter root."""
    (tmp_path / "adapters").mkdir()
    return {name: save_base(tmp_path / name, case_config(name), demo_dir / "base") for name in ("llama", "phi3")}


def registry_for(tmp_path, name) -> AdapterRegistry:
    return AdapterRegistry([tmp_path / "adapters"], case_config(name), max_rank=16)


def test_phi3_adapter_on_fused_projections_registers(tmp_path, bases):
    save_adapter(tmp_path / "adapters" / "fused", bases["phi3"], ["qkv_proj", "gate_up_proj"], r=4, seed=0)
    spec = registry_for(tmp_path, "phi3").register("fused", "fused")
    assert spec.target_modules == {"qkv_proj", "gate_up_proj"}
    assert spec.module_shapes["model.layers.0.self_attn.qkv_proj"] == (64, 4 * 16 + 2 * 2 * 16)
    assert spec.module_shapes["model.layers.1.mlp.gate_up_proj"] == (64, 2 * 128)


@pytest.mark.parametrize("made_on, served_on, targets, module", [
    ("llama", "phi3", ["q_proj", "v_proj"], "model.layers.0.self_attn.q_proj"),
    ("llama", "phi3", ["gate_proj"], "model.layers.0.mlp.gate_proj"),
    ("phi3", "llama", ["qkv_proj"], "model.layers.0.self_attn.qkv_proj"),
    ("phi3", "llama", ["gate_up_proj"], "model.layers.0.mlp.gate_up_proj"),
])
def test_adapter_for_modules_the_base_does_not_have_is_refused_by_name(tmp_path, bases, made_on, served_on,
                                                                        targets, module):
    save_adapter(tmp_path / "adapters" / "other", bases[made_on], targets, r=4, seed=0)
    with pytest.raises(AdapterTargetUnsupported, match=f"targets {module};"):
        registry_for(tmp_path, served_on).register("other", "other")


@pytest.mark.parametrize("extra, module", [("embed_tokens", "model.embed_tokens"), ("lm_head", "lm_head")])
@pytest.mark.parametrize("base", ["llama", "phi3"])
def test_embeddings_and_lm_head_are_refused_by_name(tmp_path, bases, base, extra, module):
    first = "q_proj" if base == "llama" else "qkv_proj"
    save_adapter(tmp_path / "adapters" / "head", bases[base], [first, extra], r=4, seed=0)
    with pytest.raises(AdapterTargetUnsupported, match=f"targets {module}; supported targets are"):
        registry_for(tmp_path, base).register("head", "head")


def test_registry_refuses_a_base_that_is_not_served(tmp_path):
    (tmp_path / "adapters").mkdir()
    with pytest.raises(UnsupportedModel, match="model_type 'mixtral'"):
        AdapterRegistry([tmp_path / "adapters"], tiny_config("mixtral"), max_rank=16)
