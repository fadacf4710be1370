"""A replica that cannot start: refused by build_app where that can be known up front, else a prompt 503 naming why.
Adapters the replicas refuse at start are left out of the app, and a request for one says why."""

import shutil
import time

import httpx
import pytest
from transformers import AutoConfig, MixtralConfig, Qwen2MoeConfig

from adapter_helpers import make_adapter
from app.model.architectures import UnsupportedModel
from deploy.app import build_app
from deploy.args import AppArgs
from web import HTTP

CLUSTER_ARGS = None  # each test deploys its own app
ANSWER_WITHIN_S = 60

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("config", [MixtralConfig(**TINY, num_local_experts=2),
                                    Qwen2MoeConfig(**TINY, num_experts=2, moe_intermediate_size=32)],
                         ids=["mixtral", "qwen2_moe"])
def test_build_app_refuses_an_unsupported_base_by_name(tmp_path, demo_dir, config):
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=config.model_type):
        build_app(AppArgs(base_model=str(tmp_path), adapter_roots=[str(demo_dir / "adapters")], build_demo=False))


def test_build_app_refuses_a_base_without_a_config(tmp_path, demo_dir):
    with pytest.raises(ValueError, match="config"):
        build_app(AppArgs(base_model=str(tmp_path), adapter_roots=[str(demo_dir / "adapters")], build_demo=False))


def test_requests_get_a_prompt_503_naming_the_replicas_error(cluster, demo_dir, tmp_path):
    """The config passes build_app's check; the weights are not safetensors, so every replica's constructor fails."""
    broken = tmp_path / "broken-base"
    shutil.copytree(demo_dir / "base", broken)
    (broken / "model.safetensors").write_bytes(b"these are not weights")
    cluster.deploy(replicas=1, wait_replicas=False, blocking=False, base_model=str(broken))
    deadline = time.monotonic() + 120  # the ingress itself starts first
    while time.monotonic() < deadline:
        try:
            if HTTP.get(f"{cluster.url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    for body, route in [({"model": "broken-base", "prompt": "hi", "max_tokens": 2}, "completions"),
                        ({"model": "pirate", "prompt": "hi", "max_tokens": 2, "stream": True}, "completions"),
                        ({"model": "broken-base", "messages": [{"role": "user", "content": "hi"}]}, "chat/completions")]:
        started = time.monotonic()
        response = HTTP.post(f"{cluster.url}/v1/{route}", json=body, timeout=ANSWER_WITHIN_S)
        assert time.monotonic() - started < ANSWER_WITHIN_S
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after"), response.headers
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable", error
        assert "deserializing header" in error["message"], error["message"]  # safetensors' own words


def test_adapters_refused_at_start_are_not_listed_and_a_request_for_one_says_why(cluster, demo_dir, tmp_path):
    """A missing folder and a rank past max_rank: the app serves the rest, and names each refusal's reason."""
    make_adapter(tmp_path / "wide", base=AutoConfig.from_pretrained(demo_dir / "base"), r=32, lora_alpha=32)
    adapters = {"ghost": str(tmp_path / "ghost"), "wide": str(tmp_path / "wide"),
                "pirate": str(demo_dir / "adapters" / "pirate")}
    cluster.deploy(replicas=1, adapter_roots=[str(demo_dir / "adapters"), str(tmp_path)], adapters=adapters,
                   max_rank=16)
    models = {model["id"] for model in HTTP.get(f"{cluster.url}/v1/models", timeout=10).json()["data"]}
    assert "pirate" in models and not models & {"ghost", "wide"}, models
    for name, reason in [("ghost", "no such directory"), ("wide", "rank 32 > max_rank 16")]:
        response = HTTP.post(f"{cluster.url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "adapter_invalid" and reason in error["message"], error
    response = HTTP.post(f"{cluster.url}/v1/completions", json={"model": "pirate", "prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200, response.text
    refused = [stats["refused"] for stats in cluster.replicas().values()]
    assert len(refused) == 1 and "rank 32 > max_rank 16" in refused[0]["wide"], refused
    assert "no such directory" in refused[0]["ghost"], refused
