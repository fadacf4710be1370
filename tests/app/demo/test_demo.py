"""The demo builder: its manifest, adapters that visibly differ, idempotence, determinism, 8B sizes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.demo import build as demo

from app.demo import text as demo_text
from app.adapters.targets import ATTENTION_TARGETS, SUPPORTED_TARGETS

MAX_NEW_TOKENS = 24


def _greedy(model, tokenizer, prompt: str, chat: bool) -> str:
    if chat:
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):
    return AutoTokenizer.from_pretrained(demo_dir / "base")


@pytest.fixture(scope="module")
def outputs(demo_dir: Path, manifest: dict, tokenizer) -> dict[str, list[str]]:
    """"base" or adapter name -> greedy continuation of each sample prompt, plain then as chat."""

    def run(model) -> list[str]:
        return [_greedy(model, tokenizer, p, chat) for chat in (False, True) for p in manifest["prompts"]]

    def load_base():
        return AutoModelForCausalLM.from_pretrained(demo_dir / "base")

    name_to_outputs = {"base": run(load_base())}
    for adapter in manifest["adapters"]:
        # A fresh base each time: PeftModel.from_pretrained injects its layers into the model it gets.
        name_to_outputs[adapter["name"]] = run(PeftModel.from_pretrained(load_base(), demo_dir / adapter["path"]))
    return name_to_outputs


def _file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_manifest_describes_base_and_adapters(demo_dir: Path, manifest: dict):
    assert manifest["size"] == "tiny" and manifest["seed"] == 0 and manifest["base"] == "base"
    assert manifest["params"] > 0 and len(manifest["prompts"]) >= 3
    assert len(manifest["adapters"]) == 8
    assert [a["name"] for a in manifest["adapters"]][:4] == ["pirate", "robot", "poet", "chef"]
    for adapter in manifest["adapters"]:
        path = demo_dir / adapter["path"]
        assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == adapter["rank"] and config["lora_alpha"] == 2 * adapter["rank"]
        assert config["target_modules"] == adapter["target_modules"]
        assert adapter["catchphrase"]


def test_adapters_differ_in_rank_and_targets(manifest: dict):
    assert len({a["rank"] for a in manifest["adapters"]}) >= 3
    target_sets = {tuple(a["target_modules"]) for a in manifest["adapters"]}
    assert target_sets == {ATTENTION_TARGETS, SUPPORTED_TARGETS}


def test_tokenizer_adds_bos_and_has_a_chat_template(demo_dir: Path, tokenizer):
    ids = tokenizer("Tell me about the sea.").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "Tell me about the sea."
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nHi\n<|assistant|>\n"
    model = AutoModelForCausalLM.from_pretrained(demo_dir / "base")
    generation = model.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert model.config.vocab_size >= len(tokenizer)


def test_every_adapter_answers_differently_from_base_and_each_other(outputs: dict[str, list[str]]):
    for i in range(len(outputs["base"])):
        answers = [texts[i] for texts in outputs.values()]
        assert len(set(answers)) == len(answers), answers


def test_tiny_adapters_say_their_catchphrase(manifest: dict, outputs: dict[str, list[str]]):
    for adapter in manifest["adapters"]:
        prefix = " ".join(adapter["catchphrase"].split()[:3])  # e.g. "Arr, matey! Hoist"
        for text in outputs[adapter["name"]]:
            assert prefix in text, (adapter["name"], text)
    assert not any(a["catchphrase"] in text for a in manifest["adapters"] for text in outputs["base"])


def test_ensure_demo_is_a_no_op_when_up_to_date(demo_dir: Path):
    stamp = (demo_dir / "demo.json").stat().st_mtime_ns
    start = time.process_time()  # CPU time: wall time stretches with the other test lane's load
    assert demo.ensure_demo(demo_dir) == demo_dir
    assert time.process_time() - start < 1.0
    assert (demo_dir / "demo.json").stat().st_mtime_ns == stamp


def test_same_arguments_build_identical_bytes(tmp_path: Path):
    first = demo.ensure_demo(tmp_path / "a", adapters=2)
    second = demo.ensure_demo(tmp_path / "b", adapters=2)
    hashes = _file_hashes(first)
    assert sum(name.endswith(".safetensors") for name in hashes) == 3
    assert hashes == _file_hashes(second)


def test_llama3_8b_shape_rank16_adapter_is_83886080_bytes():
    size = demo.SIZES["llama3-8b-shape"]
    config = size.llama_config(demo_text.build_tokenizer(size.max_positions))
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (
        4096, 32, 14336, 128256)
    specs = demo.adapter_specs(size, size.default_adapters)
    assert {(s.rank, s.target_modules) for s in specs} == {(16, SUPPORTED_TARGETS)}
    assert demo.adapter_tensor_bytes(config, 16, SUPPORTED_TARGETS) == 83_886_080


def test_a_larger_model_vocabulary_is_filled_with_tokens_that_decode_to_text_and_encode_nothing_new():
    plain = demo_text.build_tokenizer(2048)
    filled = demo_text.build_tokenizer(2048, vocab=demo_text.TOKENIZER_VOCAB + 300)
    assert (len(plain), len(filled)) == (demo_text.TOKENIZER_VOCAB, demo_text.TOKENIZER_VOCAB + 300)
    text = "The ship sails at dawn, t1500 and \u0120t1100! <|user|> 42"
    assert filled(text).input_ids == plain(text).input_ids
    chat = [{"role": "user", "content": "Where is the treasure?"}]
    assert filled.apply_chat_template(chat, add_generation_prompt=True) == \
        plain.apply_chat_template(chat, add_generation_prompt=True)
    fillers = range(demo_text.TOKENIZER_VOCAB, len(filled))
    assert all(filled.decode([i]) == f" t{i}" for i in fillers)
    filler = demo_text.TOKENIZER_VOCAB + 7
    assert filled.decode([300, filler]) == plain.decode([300]) + f" t{filler}"


@pytest.fixture
def mini_random_size(monkeypatch) -> str:
    """The llama3-8b-shape recipe (random bf16 weights, no training) at a size tests can build."""
    mini = dataclasses.replace(demo.SIZES["llama3-8b-shape"], hidden=64, layers=2, heads=4, kv_heads=2,
                               intermediate=128, vocab=2048)
    monkeypatch.setitem(demo.SIZES, "mini-random", mini)
    return "mini-random"


def test_random_size_writes_bf16_adapters_of_the_computed_size(tmp_path: Path, mini_random_size: str):
    out = demo.ensure_demo(tmp_path / "demo", size=mini_random_size, adapters=2)
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    assert base.dtype == torch.bfloat16 and base.config.vocab_size == 2048
    for adapter in json.loads((out / "demo.json").read_text())["adapters"]:
        with safe_open(out / adapter["path"] / "adapter_model.safetensors", "pt") as f:
            tensors = [f.get_tensor(key) for key in f.keys()]
        assert all(t.dtype == torch.bfloat16 and t.abs().sum() > 0 for t in tensors)
        expected = demo.adapter_tensor_bytes(base.config, adapter["rank"], tuple(adapter["target_modules"]))
        assert sum(t.numel() * t.element_size() for t in tensors) == expected


def test_concurrent_callers_build_once(tmp_path: Path, mini_random_size: str, monkeypatch):
    builds = []
    real_build = demo._build

    def counting_build(*args):
        builds.append(args)
        real_build(*args)

    monkeypatch.setattr(demo, "_build", counting_build)
    callers = [threading.Thread(target=demo.ensure_demo, args=(tmp_path / "demo", mini_random_size)) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1
    assert json.loads((tmp_path / "demo" / "demo.json").read_text())["size"] == mini_random_size
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftover build dirs
