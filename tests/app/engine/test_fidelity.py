"""Served tokens equal what PEFT itself produces for the same adapter and prompt."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_helpers import assert_bf16_fidelity, greedy, run_all

MAX_NEW = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def references(demo_dir, manifest):
    """(adapter or None, prompt) -> (PEFT greedy tokens, PEFT prompt logits), float32."""
    tokenizer = AutoTokenizer.from_pretrained(Path(demo_dir) / "base")
    out = {}
    for adapter in [None] + [a["path"] for a in manifest["adapters"]]:
        model = AutoModelForCausalLM.from_pretrained(Path(demo_dir) / "base", dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, Path(demo_dir) / adapter)
        model.eval()
        for prompt in manifest["prompts"][:2]:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                generated = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
                logits = model(**inputs).logits[0]
            name = None if adapter is None else Path(adapter).name
            out[name, prompt] = (generated[0, inputs["input_ids"].shape[1]:].tolist(), logits)
    return out


def test_greedy_tokens_equal_peft_generate(make_engine, references):
    engine = make_engine(num_slots=8)
    ids = {}
    for (adapter, prompt) in references:
        request = engine.add_request(prompt, adapter, greedy(MAX_NEW))
        ids[request.request_id] = (adapter, prompt)
    tokens = run_all(engine, check=True)
    for request_id, key in ids.items():
        assert tokens[request_id] == references[key][0], key


def test_prompt_logits_within_1e_4(make_engine, references):
    engine = make_engine(num_slots=2)
    for (adapter, prompt), (_, expected) in references.items():
        got = engine.prompt_logits(prompt, adapter)
        assert (got - expected).abs().max().item() <= 1e-4, (adapter, prompt)
    engine.check_invariants()


@pytest.mark.gpu
@needs_cuda
def test_bf16_fidelity_against_peft(make_engine, demo_dir, manifest):
    engine = make_engine(num_slots=8, device="cuda", dtype="bfloat16")
    assert_bf16_fidelity(engine, demo_dir, manifest["prompts"][0],
                         {a["name"]: a["path"] for a in manifest["adapters"]}, MAX_NEW)
