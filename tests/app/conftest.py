"""Engine fixtures over the tiny demo."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine.engine import LLMEngine
from engine_helpers import engine_config


@pytest.fixture(scope="session")
def manifest(demo_dir):
    return json.loads((Path(demo_dir) / "demo.json").read_text())


@pytest.fixture(scope="session")
def adapter_names(manifest):
    return [a["name"] for a in manifest["adapters"]]


@pytest.fixture
def make_engine(demo_dir, manifest):
    engines = []

    def make(register=True, **overrides) -> LLMEngine:
        engine = LLMEngine(engine_config(demo_dir, **overrides))
        if register:
            for adapter in manifest["adapters"]:
                engine.register_adapter(adapter["name"], str(Path(demo_dir) / adapter["path"]))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="session")
def churn_root(tmp_path_factory, demo_dir, manifest):
    """24 distinct adapters: the demo's, each also scaled by 1.5 and by 0.5."""
    root = tmp_path_factory.mktemp("churn")
    names = []
    for factor in (1.0, 1.5, 0.5):
        for adapter in manifest["adapters"]:
            name = f"{adapter['name']}-x{factor}"
            src, dst = Path(demo_dir) / adapter["path"], root / name
            dst.mkdir()
            (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
            tensors = load_file(src / "adapter_model.safetensors")
            tensors = {k: (v * factor if "lora_B" in k else v).contiguous() for k, v in tensors.items()}
            save_file(tensors, dst / "adapter_model.safetensors")
            names.append(name)
    while len(names) < 24:
        raise AssertionError("the demo needs at least 8 adapters")
    return root, names[:24]


@pytest.fixture(scope="session")
def graph_model(tmp_path_factory, demo_dir):
    """A random model whose head_dim (64) the Triton decode kernel takes, with three random adapters of
    mixed ranks: the tiny demo's head_dim (16) runs the torch reference, without graphs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("graphs")
    tokenizer = AutoTokenizer.from_pretrained(Path(demo_dir) / "base")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    for i, rank in enumerate((4, 8, 16)):
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                                    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.data.normal_(0, 0.05)
        peft_model.save_pretrained(root / "adapters" / f"a{i}")
    return root
