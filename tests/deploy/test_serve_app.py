"""The Ray Serve application end to end, on a local cluster with 2 CPU replicas of the tiny demo."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError
from transformers import AutoTokenizer

from deploy.state import find_router_state
from traffic import PROMPT, demo_adapters, expected_texts, wait_for
from web import HTTP


@pytest.fixture(scope="module")
def manifest(demo_dir):
    return json.loads((Path(demo_dir) / "demo.json").read_text())


@pytest.fixture(scope="module")
def expected(demo_dir):
    """Engine-alone greedy text for every adapter and the base model."""
    return expected_texts(demo_dir, demo_adapters(demo_dir))


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(cluster, model, prompt=PROMPT, **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    return HTTP.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


def test_openai_client_models_complete_stream_chat(cluster, oai, manifest, expected):
    models = {m.id: m for m in oai.models.list().data}
    assert "base" in models and models["base"].model_extra["root"].endswith("base")
    for adapter in manifest["adapters"]:
        entry = models[adapter["name"]]
        assert entry.model_extra["parent"] == "base" and entry.model_extra["root"].endswith(adapter["path"])
    for model, text in expected.items():
        completion = oai.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        assert completion.choices[0].text == text, model
        streamed = "".join(c.choices[0].text for c in oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
        assert streamed == text, model
    robot = manifest["adapters"][0]["name"]
    chat = oai.chat.completions.create(model=robot, messages=[{"role": "user", "content": "Who are you?"}],
                                       max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=robot, messages=[{"role": "user", "content": "Who are you?"}], max_tokens=16, temperature=0,
        stream=True))
    assert streamed == chat.choices[0].message.content


def test_unknown_model_is_404_with_openai_body(cluster, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "adapter_not_found"
    response = complete(cluster, "../etc")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "code"}


def test_error_statuses(cluster):
    url = f"{cluster.url}/v1/completions"
    bad_json = HTTP.post(url, content=b'{"model": "base", "prompt": ', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    wrong_type = HTTP.post(url, json={"model": "base", "prompt": "x", "max_tokens": "many"})
    assert wrong_type.status_code == 422 and wrong_type.json()["error"]["type"] == "invalid_request_error"
    too_big = HTTP.post(url, json={"model": "base", "prompt": "x" * 70000})
    assert too_big.status_code == 413 and "limit" in too_big.json()["error"]["message"]
    too_long = complete(cluster, "base", prompt="word " * 400)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert HTTP.get(f"{cluster.url}/health").json() == {"status": "ok"}


def test_overload_is_429_with_retry_after(cluster):
    def slow(i):  # long enough that 49 of the 64 are in flight at once however slowly the client threads start
        return complete(cluster, "base", max_tokens=160, ignore_eos=True)

    with ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(slow, range(64)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    limited = [r for r in responses if r.status_code == 429]
    assert limited and limited[0].headers["retry-after"] == "1"
    assert limited[0].json()["error"]["type"] == "rate_limit_error"
    assert codes.count(200) >= 48


def test_affinity_repeated_requests_stay_on_the_holding_replica(cluster, manifest):
    adapter = manifest["adapters"][3]["name"]
    replicas = [complete(cluster, adapter).headers["x-replica-id"] for _ in range(6)]
    assert len(set(replicas)) == 1, replicas
    view = cluster.replicas()
    assert adapter in view[replicas[0]]["resident"]


def test_a_replica_reports_the_calls_it_serves(cluster, manifest):
    """The router places by each replica's reported `ongoing` where Serve's queue-length cache lacks the replica: a
    replica serving a call must say so, or it looks idle."""
    body = {"model": manifest["adapters"][0]["name"], "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}

    def ongoing() -> list[int]:
        return sorted(stats["ongoing"] for stats in cluster.replicas().values())

    def until(expected: list[int], timeout_s: float, what: str) -> None:
        deadline, seen = time.time() + timeout_s, ongoing()
        while seen != expected:
            assert time.time() < deadline, f"{what}: the replicas report {seen} calls, not {expected}"
            time.sleep(0.05)
            seen = ongoing()

    with HTTP.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a generator dropped closes the connection, which ends the call
        next(lines)  # the call is being served; it waits for the client, which reads no more
        until([0, 1], 30, "during the call")
    until([0, 0], 30, "after the call")


def totals(view: dict) -> dict:
    keys = ("hint_hits", "inflight_hits", "misses", "hints_received", "hints_duplicate", "hinted_on_device",
            "hinted_in_host", "hinted_from_disk")
    out = {**dict.fromkeys(keys, 0), "lead_count": 0, "lead_sum": 0.0}
    for stats in view.values():
        for key in keys:
            out[key] += stats["arrivals"][key]
        out["lead_count"] += stats["hint_lead_seconds"]["count"]
        out["lead_sum"] += stats["hint_lead_seconds"]["sum"]
    return out


def test_hints_reach_replicas_before_their_requests(cluster, manifest):
    """Saturate both replicas: pending requests are hinted, and their adapters are resident on arrival."""
    names = [a["name"] for a in manifest["adapters"]]
    before = totals(cluster.replicas())
    jobs = [names[i % len(names)] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(lambda m: complete(cluster, m, max_tokens=24, ignore_eos=True).status_code, jobs))
    assert codes == [200] * 32
    time.sleep(1.5)  # the replicas' next report
    after = totals(cluster.replicas())
    delta = {k: after[k] - before[k] for k in after}
    print("hint deltas:", delta)
    assert delta["hints_received"] > 0
    assert delta["hints_duplicate"] == 0, "a request turned away by a full replica was hinted again"
    assert delta["lead_count"] > 0 and delta["lead_sum"] > 0, "no hint arrived before its request"
    # Of the arrivals that had waited hinted, most found their adapter in a slot or loading. (Over all arrivals
    # the hit rate says little here: 8 adapters cycle over 12 slots, and without hints it measured 0.50-0.63.)
    hinted = delta["hinted_on_device"] + delta["hinted_in_host"] + delta["hinted_from_disk"]
    assert hinted >= 1 and delta["hinted_on_device"] >= 0.5 * hinted, delta


LOAD_BATCH = 16  # answers that show the background load flowing: more than each of its 4 clients has in flight


def load_in_background(cluster, names, stop: threading.Event, results: list):
    def run():
        i = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                body = {"model": names[i % len(names)], "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
                try:
                    results.append(client.post(f"{cluster.url}/v1/completions", json=body).status_code)
                except httpx.HTTPError as e:
                    results.append(repr(e))
                i += 1

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    return threads


def answers(actor) -> bool:
    try:
        ray.get(actor.view.remote(), timeout=5)
        return True
    except GetTimeoutError:
        return True
    except RayActorError:
        return False


def test_router_actor_killed_mid_load_fails_nothing_and_recovers(cluster, manifest):
    names = [a["name"] for a in manifest["adapters"]]
    epoch = HTTP.get(f"{cluster.url}/v1/debug/replicas").json()["epoch"]
    stop, results = threading.Event(), []
    threads = load_in_background(cluster, names, stop, results)
    wait_for(lambda: len(results) >= LOAD_BATCH, 30, poll_s=0.05, what="load before the kill")
    old = find_router_state("lora", None)
    ray.kill(old)
    wait_for(lambda: not answers(old), 10, what="the killed router actor is gone")
    # A registry change needs the router actor. The ingress's next call goes to the actor it knew, which is gone:
    # the answer is a clean 503 with Retry-After (Serve may have started the next actor by then).
    during = HTTP.delete(f"{cluster.url}/v1/adapters/never-registered")
    deadline = time.time() + 60
    while time.time() < deadline:
        response = HTTP.get(f"{cluster.url}/v1/debug/replicas")
        if response.status_code == 200 and response.json()["epoch"] != epoch and len(response.json()["replicas"]) == 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail("no new router actor took over")
    taken_over = len(results)
    wait_for(lambda: len(results) >= taken_over + LOAD_BATCH, 30, poll_s=0.05, what="load through the new actor")
    stop.set()
    for t in threads:
        t.join()
    assert results and all(code == 200 for code in results), [c for c in results if c != 200][:5]
    assert during.status_code == 503 and during.headers.get("retry-after") == "1", during.text
    assert during.json()["error"]["code"] == "engine_unavailable"
    models = {m["id"] for m in HTTP.get(f"{cluster.url}/v1/models").json()["data"]}
    assert set(names) <= models


def test_register_and_unregister_adapter_over_http(cluster, manifest, demo_dir):
    path = f"{demo_dir}/{manifest['adapters'][1]['path']}"
    created = HTTP.post(f"{cluster.url}/v1/adapters", json={"name": "dynamic-one", "path": path})
    assert created.status_code == 201, created.text
    assert complete(cluster, "dynamic-one").status_code == 200
    outside = HTTP.post(f"{cluster.url}/v1/adapters", json={"name": "evil", "path": "/etc"})
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "adapter_path_outside_roots"
    assert HTTP.delete(f"{cluster.url}/v1/adapters/dynamic-one").status_code == 200
    assert complete(cluster, "dynamic-one").status_code == 404


def test_vllm_adapter_routes_load_and_unload(cluster, manifest, demo_dir):
    path = f"{demo_dir}/{manifest['adapters'][1]['path']}"

    def post(route, **body):
        return HTTP.post(f"{cluster.url}/v1/{route}", json=body, timeout=60)

    loaded = post("load_lora_adapter", lora_name="vllm-one", lora_path=path)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'vllm-one' added successfully."
    assert complete(cluster, "vllm-one").status_code == 200
    for body, status, code in [({"lora_name": "vllm-one", "lora_path": path}, 409, "adapter_exists"),
                               ({"lora_name": "evil", "lora_path": "/etc"}, 400, "adapter_path_outside_roots"),
                               ({"lora_name": "a/b", "lora_path": path}, 400, None),
                               ({"lora_name": "x", "lora_path": path, "load_inplace": True}, 400,
                                "unsupported_parameter")]:
        refused = post("load_lora_adapter", **body)
        assert refused.status_code == status and (code is None or refused.json()["error"]["code"] == code), body
    unloaded = post("unload_lora_adapter", lora_name="vllm-one")
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'vllm-one' removed successfully."
    assert complete(cluster, "vllm-one").status_code == 404
    gone = post("unload_lora_adapter", lora_name="vllm-one")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"


def test_tokenize_and_detokenize_use_the_generation_routes_tokenization(cluster, oai, manifest):
    tokenizer = AutoTokenizer.from_pretrained(f"{cluster.demo_dir}/base")
    robot = manifest["adapters"][0]["name"]

    def post(route, **body):
        return HTTP.post(f"{cluster.url}/{route}", json=body, timeout=60)

    text = post("tokenize", model="base", prompt=PROMPT).json()
    usage = oai.completions.create(model="base", prompt=PROMPT, max_tokens=1).usage
    assert text["tokens"] == tokenizer(PROMPT)["input_ids"] and text["count"] == usage.prompt_tokens
    assert text["max_model_len"] == 256  # the fixture's max_input_tokens
    assert post("tokenize", model="base", prompt=PROMPT, add_special_tokens=False).json()["tokens"] == \
        tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert post("detokenize", model=robot, tokens=text["tokens"]).json() == {"prompt": tokenizer.decode(text["tokens"])}
    assert PROMPT in tokenizer.decode(text["tokens"])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Who are you?"}]}]
    chat = post("tokenize", model=robot, messages=messages).json()
    usage = oai.chat.completions.create(model=robot, messages=messages, max_tokens=1).usage
    assert chat["count"] == len(chat["tokens"]) == usage.prompt_tokens
    template = tokenizer.apply_chat_template([{"role": "user", "content": "Who are you?"}],
                                             add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(template, add_special_tokens=False)["input_ids"]
    assert post("detokenize", model="base", tokens=chat["tokens"]).json()["prompt"] == template
    vocab = len(tokenizer)
    for route, body, status in [
        ("detokenize", {"tokens": [1, 10**6]}, 400), ("detokenize", {"tokens": [True]}, 422),
        ("detokenize", {"tokens": [1.0]}, 422), ("detokenize", {"tokens": [-1]}, 422),
        ("detokenize", {"tokens": ["1"]}, 422), ("detokenize", {"tokens": [1], "skip": True}, 400),
        ("tokenize", {"prompt": "a", "messages": messages}, 422), ("tokenize", {}, 422),
        ("tokenize", {"prompt": "a", "add_generation_prompt": False}, 422),
        ("tokenize", {"prompt": "a", "return_token_strs": True}, 400),
        ("tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ]:
        refused = post(route, model="base", **body)
        assert refused.status_code == status, (route, body, refused.text)
    assert post("detokenize", model="base", tokens=[vocab - 1]).status_code == 200
    assert post("tokenize", model="no-such-adapter", prompt="a").status_code == 404


def test_scale_two_to_three_by_config_update_fails_nothing(cluster, manifest):
    names = [a["name"] for a in manifest["adapters"]]
    stop, results = threading.Event(), []
    threads = load_in_background(cluster, names, stop, results)
    wait_for(lambda: len(results) >= LOAD_BATCH, 30, poll_s=0.05, what="load before the update")
    cluster.deploy(replicas=3, wait_replicas=False)
    cluster.wait_for_replicas(3)
    scaled = len(results)
    wait_for(lambda: len(results) >= scaled + LOAD_BATCH, 30, poll_s=0.05, what="load on three replicas")
    stop.set()
    for t in threads:
        t.join()
    assert results and all(code == 200 for code in results), [c for c in results if c != 200][:5]
    seen = {complete(cluster, name).headers["x-replica-id"] for name in names * 2}
    assert len(seen) >= 2


def test_openai_surface_logprobs_echo_n_batch_prompts_and_refusals(cluster, oai, manifest):
    """What evaluation harnesses and the openai client send, over HTTP."""
    # Multiple-choice scoring: echo the prompt with its logprobs, one token of completion (and none).
    for max_tokens in (1, 0):
        scored = oai.completions.create(model="pirate", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0)
        choice = scored.choices[0]
        assert choice.text.startswith(PROMPT) and choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == scored.usage.prompt_tokens + max_tokens
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    # n choices and batch prompts: index = prompt * n + j, each equal to the same request alone.
    batch = oai.completions.create(model="robot", prompt=[PROMPT, "Hello!"], n=2, max_tokens=6, temperature=0.9,
                                   seed=5)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = oai.completions.create(model="robot", prompt="Hello!", max_tokens=6, temperature=0.9, seed=6)
    assert batch.choices[3].text == alone.choices[0].text  # choice j uses seed + j
    streamed = {}
    for chunk in oai.completions.create(model="robot", prompt=[PROMPT, "Hello!"], n=2, max_tokens=6,
                                        temperature=0.9, seed=5, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in batch.choices}
    # Chat: logprobs with top_logprobs, text content parts, n.
    chat = oai.chat.completions.create(model="pirate", n=2, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, messages=[{"role": "user", "content": [
                                           {"type": "text", "text": "Who are you?"}]}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens // 2 and all(len(e.top_logprobs) == 2 for e in entries)
    # Penalties and logit_bias change the decoding they are sent with.
    eos_free = oai.completions.create(model="base", prompt=PROMPT, max_tokens=3, temperature=0,
                                      logit_bias={"40": 100}, extra_body={"ignore_eos": True})
    assert eos_free.usage.completion_tokens == 3 and eos_free.choices[0].text
    # Refusals name the field.
    for extra, field in (({"guided_json": {}}, "guided_json"), ({"suffix": "x"}, "suffix"),
                         ({"best_of": 3}, "best_of")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="base", prompt="hi", max_tokens=2, extra_body=extra)
        assert field in info.value.body["message"] and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError, match="image_url"):
        oai.chat.completions.create(model="base", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
