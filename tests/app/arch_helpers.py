"""Tiny random configs of the declared architectures (and of refused ones), and the folders an engine serves from:
a base model saved with the demo's tokenizer, and PEFT adapters on it. Nothing comes from the Hub."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from app.model.architectures import check_supported

COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False, initializer_range=0.1)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]

# name -> (model_type, overrides). Windows of 5-7 tokens start mid-block (block_size 16) and pass within a prompt;
# caps of 1-2 bite on scores and logits of this size.
CASES = {
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(sliding_window=6, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                              query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", dict(sliding_window=7, layer_types=SLIDING_THEN_FULL, query_pre_attn_scalar=16,
                                   final_logit_softcapping=2.0)),
    "phi3": ("phi3", dict(sliding_window=7)),
}


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **{**COMMON, **overrides})


def case_config(name: str, **more) -> PretrainedConfig:
    model_type, overrides = CASES[name]
    return tiny_config(model_type, **{**overrides, **more})


def save_base(folder: Path, config: PretrainedConfig, tokenizer_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms and biases start constant (Gemma's norms and every bias at 0): make them count
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, folder / file)
    return folder


def save_adapter(folder: Path, base_dir: Path, targets, r: int, seed: int) -> Path:
    """A PEFT LoRA on `targets` with random lora_B, so the adapter changes the output."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(targets)))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(std=0.1)
        model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_case(root: Path, name: str, tokenizer_dir: Path, **more) -> dict:
    """root/base and root/adapters/{all,some}: one adapter on every declared target, one on two of them."""
    config = case_config(name, **more)
    arch = check_supported(config)
    base = save_base(root / "base", config, tokenizer_dir)
    names = arch.target_names
    save_adapter(root / "adapters" / "all", base, names, r=8, seed=1)
    save_adapter(root / "adapters" / "some", base, (names[0], names[2]), r=4, seed=2)
    return {"config": config, "arch": arch, "adapters": ["all", "some"]}


def peft_references(root: Path, adapters, prompts, max_new: int) -> dict:
    """(adapter or None, prompt) -> (PeftModel.generate's greedy tokens, the prompt's logits), float32, for the base
    in root/base and each adapter under root/adapters."""
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    references = {}
    for adapter in [None, *adapters]:
        model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, root / "adapters" / adapter)
        model.eval()
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                generated = model.generate(**inputs, do_sample=False, max_new_tokens=max_new)
                logits = model(**inputs).logits[0]
            references[adapter, prompt] = (generated[0, inputs["input_ids"].shape[1]:].tolist(), logits)
    return references
