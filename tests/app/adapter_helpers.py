"""Adapters written by PEFT on the fly for the registry and adapter-read tests, and their fixtures."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME, AdapterRegistry
from app.adapters.targets import ATTENTION_TARGETS

ATTN = list(ATTENTION_TARGETS)


def llama_config(hidden: int = 64, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
    )


BASE = llama_config()


def make_adapter(folder: Path, base: LlamaConfig = BASE, safe: bool = True, **lora_kwargs):
    """Train-free PEFT adapter: random lora_B so the delta is nonzero. Returns the PeftModel."""
    torch.manual_seed(0)
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM(base), LoraConfig(**lora_kwargs))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_()
        model.save_pretrained(folder, safe_serialization=safe)
    return model


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / CONFIG_NAME).read_text())
    config.update(changes)
    (folder / CONFIG_NAME).write_text(json.dumps(config))


def edit_tensors(folder: Path, edit) -> None:
    with safe_open(folder / WEIGHTS_NAME, framework="pt") as f:
        metadata = f.metadata()  # kept, so an in-place value edit keeps the file size
    tensors = load_file(folder / WEIGHTS_NAME)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS_NAME, metadata=metadata)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # relative adapter paths must not resolve against the test runner's cwd
    (tmp_path / "adapters").mkdir()
    return tmp_path / "adapters"


@pytest.fixture
def registry(root) -> AdapterRegistry:
    return AdapterRegistry([root], BASE, max_rank=16)


@pytest.fixture
def good(root) -> Path:
    make_adapter(root / "good", r=8, lora_alpha=16)
    return root / "good"
