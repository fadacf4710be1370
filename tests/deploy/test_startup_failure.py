"""A replica that cannot start: refused by build_app where that can be known up front, else a prompt 503 naming why.
Adapters the replicas refuse at start are left out of the app, and a request for one says why. The two apps,
/broken and /refusing, are deployed at once and start side by side."""

import shutil
import time

import httpx
import pytest
from ray.serve.schema import ServeDeploySchema
from transformers import AutoConfig, MixtralConfig, Qwen2MoeConfig

from adapter_helpers import make_adapter
from app.model.architectures import UnsupportedModel
from deploy.app import build_app
from deploy.args import AppArgs
from traffic import replica_view, wait_for
from web import HTTP

CLUSTER_ARGS = None  # the `apps` fixture deploys
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


@pytest.fixture(scope="module")
def apps(cluster, demo_dir, tmp_path_factory) -> dict[str, str]:
    """Both apps, deployed at once, one replica each; yields their URLs.
    /broken: the base passes build_app's check, but its weights are not safetensors, so every replica's constructor
    fails. /refusing: a missing adapter folder and an adapter whose rank is past max_rank, beside the demo's."""
    folder = tmp_path_factory.mktemp("startup")
    broken = folder / "broken-base"
    shutil.copytree(demo_dir / "base", broken)
    (broken / "model.safetensors").write_bytes(b"these are not weights")
    roots = folder / "roots"
    make_adapter(roots / "wide", base=AutoConfig.from_pretrained(demo_dir / "base"), r=32, lora_alpha=32)
    adapters = {"ghost": str(roots / "ghost"), "wide": str(roots / "wide"),
                "pirate": str(demo_dir / "adapters" / "pirate")}
    cluster.client.deploy_apps(ServeDeploySchema.model_validate({"applications": [
        cluster.application("broken", "/broken", replicas=1, base_model=str(broken)),
        cluster.application("refusing", "/refusing", replicas=1, adapter_roots=[str(demo_dir / "adapters"), str(roots)],
                            adapters=adapters, max_rank=16)]}), _blocking=False)
    return {name: f"{cluster.url}/{name}" for name in ("broken", "refusing")}


def test_requests_get_a_prompt_503_naming_the_replicas_error(apps):
    url = apps["broken"]
    deadline = time.monotonic() + 120  # the ingress itself starts first
    while time.monotonic() < deadline:
        try:
            if HTTP.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    for body, route in [({"model": "broken-base", "prompt": "hi", "max_tokens": 2}, "completions"),
                        ({"model": "pirate", "prompt": "hi", "max_tokens": 2, "stream": True}, "completions"),
                        ({"model": "broken-base", "messages": [{"role": "user", "content": "hi"}]}, "chat/completions")]:
        started = time.monotonic()
        response = HTTP.post(f"{url}/v1/{route}", json=body, timeout=ANSWER_WITHIN_S)
        assert time.monotonic() - started < ANSWER_WITHIN_S
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after"), response.headers
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable", error
        assert "deserializing header" in error["message"], error["message"]  # safetensors' own words


def test_adapters_refused_at_start_are_not_listed_and_a_request_for_one_says_why(apps):
    """The app serves the rest, and names each refusal's reason."""
    url = apps["refusing"]
    wait_for(lambda: len(replica_view(url)) == 1, 180, poll_s=0.2, what="the replica reporting")
    models = {model["id"] for model in HTTP.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert "pirate" in models and not models & {"ghost", "wide"}, models
    for name, reason in [("ghost", "no such directory"), ("wide", "rank 32 > max_rank 16")]:
        response = HTTP.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "adapter_invalid" and reason in error["message"], error
    response = HTTP.post(f"{url}/v1/completions", json={"model": "pirate", "prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200, response.text
    refused = [stats["refused"] for stats in replica_view(url).values()]
    assert len(refused) == 1 and "rank 32 > max_rank 16" in refused[0]["wide"], refused
    assert "no such directory" in refused[0]["ghost"], refused
