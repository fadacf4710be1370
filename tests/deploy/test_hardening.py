"""Hardening over HTTP: bad input, fuzzing, client disconnects and auth, on a local cluster with one replica.
The auth tests run last, on the app redeployed with an API key, adapter registration off and the engine in its own
process (the redeploy that test_engine_in_its_own_process_serves_the_same_text checks).

Status choices, where OpenAI leaves room:
- A body that is not a JSON object (bad JSON, bad UTF-8, another content type) is 400; a JSON object
  with a field of the wrong type, range or presence is 422 (pydantic at the edge), but for a missing `model`:
  400, as OpenAI answers.
- max_tokens past MAX_TOKENS_LIMIT (2**20) is 422; within it but past the KV budget
  (prompt + max_tokens > max_total_tokens) it is 400 invalid_request.
- A prompt of control characters is valid text: 200.
"""

import json
import math
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.schemas import MAX_TOKENS_LIMIT
from bad_inputs import BAD_INPUT, CONTROL, completion
from deploy.args import AppArgs
from traffic import demo_adapters, expected_texts
from web import HTTP

PROMPT = "Tell me a story."
KEY = "secret-key"
CLUSTER_REPLICAS = 1  # nothing here is about how requests spread over replicas
ERROR_KEYS = {"message", "type", "code"}


def assert_openai_error(response: httpx.Response) -> dict:
    """The body is {"error": {"message", "type", "code"}} with string values, and "param" (OpenAI's name for
    the offending field) where an error names one."""
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) - {"param"} == ERROR_KEYS and all(isinstance(error[k], str) for k in ERROR_KEYS), error
    assert isinstance(error.get("param", ""), str), error
    return error


def assert_healthy(cluster, headers=None) -> None:
    assert HTTP.get(f"{cluster.url}/health", timeout=10).json() == {"status": "ok"}
    done = HTTP.post(f"{cluster.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": "base", "prompt": PROMPT, "max_tokens": 4})
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"], done.text
    chat = HTTP.post(f"{cluster.url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": "pirate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text


# --- the bad input table (bad_inputs.py) -----------------------------------------------------


def test_bad_input_table_gives_clean_4xx_and_the_server_stays_healthy(cluster):
    failures = []
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for case in BAD_INPUT:
            response = case.send(client)
            try:
                assert response.status_code == case.status, f"status {response.status_code}"
                if case.status != 200:
                    error = assert_openai_error(response)
                    assert case.code is None or error["code"] == case.code, f"code {error['code']}"
            except (AssertionError, ValueError, KeyError) as e:
                failures.append(f"{case.name}: want {case.status}, {e}; body {response.text[:200]!r}")
        # Starlette's own errors come in the same shape.
        for response, status in ((client.get("/v1/no-such-route"), 404), (client.get("/v1/completions"), 405)):
            if response.status_code != status or "error" not in response.text:
                failures.append(f"{response.request.url.path}: want {status}, got {response.status_code} "
                                f"{response.text[:200]!r}")
            else:
                assert_openai_error(response)
    assert not failures, "\n".join(failures)
    assert_healthy(cluster)


# --- fuzzing ------------------------------------------------------------------------------------

# Valid requests stay short: at most MAX_FUZZ_TOKENS tokens, and no garbage value parses to a longer run.
MAX_FUZZ_TOKENS = 4
DROP = object()  # a mutation that removes the field
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff"])
TEXT = st.text(max_size=24) | SURROGATES | st.sampled_from(["", "\x00", CONTROL, "é" * 30, "😀 中文"])
HUGE = st.sampled_from([2**31, 2**63, 2**64, 10**30, -10**30, 1e308, -1e308, 1e-320, -0.0, math.inf, -math.inf,
                        math.nan])
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | HUGE
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)
GARBAGE = JSON | st.just(DROP)
NOT_A_NUMBER = st.none() | st.booleans() | st.text(alphabet="abc xyz", max_size=8) | st.lists(SCALAR, max_size=2)

VALID_TEXT = st.text(min_size=1, max_size=24)
VALID_COMMON = {
    "max_tokens": st.integers(1, MAX_FUZZ_TOKENS),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-30, 1e-300, 2]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.just(1e-300),
    "top_k": st.integers(-1, 2000) | st.just(10**30),
    "seed": st.integers(0, 2**63 - 1),
    "stop": VALID_TEXT | st.lists(VALID_TEXT, max_size=8),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=8),
}
GARBAGE_COMMON = {
    "model": st.sampled_from(["no-such", "a/b", "..", "x\x00", "", "BASE", "m" * 300]) | TEXT | GARBAGE,
    "max_tokens": st.sampled_from([0, -1, 4096, MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1, 10**30, 2.5, 1e308, math.nan,
                                   math.inf, DROP]) | NOT_A_NUMBER,
    **{key: HUGE | GARBAGE for key in ("temperature", "top_p", "top_k", "seed")},
    "stop": TEXT | st.lists(TEXT, max_size=10) | GARBAGE,
    **{key: GARBAGE for key in ("stream", "stream_options", "n", "ignore_eos", "user", "logit_bias", "")},
}
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=40)}), min_size=1, max_size=4)
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard", ""]) | JSON,
    "content": TEXT | JSON, "name": TEXT})
COMPLETION = ({"model": st.sampled_from(["base", "pirate", "robot"]),
               "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 1023), min_size=1, max_size=8)},
              {**GARBAGE_COMMON, "prompt": TEXT | st.lists(st.integers(-3, 1100), max_size=8) | GARBAGE,
               "echo": GARBAGE, "logprobs": GARBAGE, "suffix": GARBAGE})
CHAT = ({"model": st.sampled_from(["base", "pirate", "robot"]), "messages": VALID_MESSAGES},
        {**GARBAGE_COMMON, "messages": st.lists(MESSAGE, max_size=4) | GARBAGE, "logprobs": GARBAGE,
         "top_logprobs": GARBAGE})


@st.composite
def mutated(draw, required: dict, garbage: dict) -> dict:
    """A valid body with up to three fields replaced by garbage, dropped, or added."""
    body = draw(st.fixed_dictionaries(required, optional=VALID_COMMON))
    for key in draw(st.lists(st.sampled_from(sorted(garbage)), max_size=3, unique=True)):
        value = draw(garbage[key])
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def encode(body) -> bytes:
    return json.dumps(body).encode()  # ASCII JSON: lone surrogates and NaN get through


def bodies(required: dict, garbage: dict):
    """Mostly valid bodies with a few bad fields; sometimes any JSON object, any JSON or any bytes."""
    near_valid = mutated(required, garbage).map(encode)
    junk = st.fixed_dictionaries({}, optional=garbage).map(lambda b: {k: v for k, v in b.items() if v is not DROP})
    return st.one_of(near_valid, near_valid, near_valid, junk.map(encode), JSON.map(encode), st.binary(max_size=64))


COMPLETION_BODIES = bodies(*COMPLETION)
CHAT_BODIES = bodies(*CHAT)
FUZZ = settings(max_examples=500, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def check_fuzz_response(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n") and '"server_error"' not in response.text, response.text
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length"), response.text
    else:
        assert_openai_error(response)


@pytest.mark.parametrize("path, strategy", [("/v1/completions", COMPLETION_BODIES),
                                            ("/v1/chat/completions", CHAT_BODIES)], ids=["completions", "chat"])
def test_fuzzed_requests_never_get_5xx(cluster, path, strategy):
    with httpx.Client(base_url=cluster.url, timeout=60, headers={"content-type": "application/json"}) as client:
        @FUZZ
        @given(body=strategy)
        def fuzz(body: bytes):
            check_fuzz_response(client.post(path, content=body))

        fuzz()
    assert_healthy(cluster)


# --- cancellation -------------------------------------------------------------------------------


def busy(cluster) -> dict:
    """Rows, queued requests and pinned slots over all replicas (as last reported to the router actor)."""
    view = cluster.replicas()
    return {key: sum(stats.get(key, 0) for stats in view.values()) for key in ("running", "waiting", "pinned_slots")}


def rows(cluster) -> dict:
    """Running rows by replica id, replicas with none left out."""
    return {uid: stats["running"] for uid, stats in cluster.replicas().items() if stats["running"]}


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not true within {timeout_s}s")
        time.sleep(poll_s)
    return time.monotonic() - started


def open_stream(client: httpx.Client, model: str):
    """A streamed completion that runs for seconds (~2000 tokens), after its first 3 events were read."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    events = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
    assert all(next(events)["choices"][0]["finish_reason"] is None for _ in range(3))
    return response, events


def drain(events, stop: threading.Event, ended: list) -> None:
    for _ in events:
        if stop.is_set():
            break
    ended.append(time.monotonic())


@pytest.mark.parametrize("model", ["base", "robot"])
def test_client_disconnect_mid_stream_frees_the_row_and_the_slot_pin(cluster, model):
    """Two long streams, one client hangs up: its row goes within a report period while the other one runs on."""
    wait_for(lambda: not any(busy(cluster).values()), 10)
    stop, ended = threading.Event(), []
    with httpx.Client(base_url=cluster.url, timeout=30) as client:
        (gone, _), (kept, kept_events) = open_stream(client, model), open_stream(client, model)
        reader = threading.Thread(target=drain, args=(kept_events, stop, ended))  # a client that keeps reading
        reader.start()
        on = [response.headers["x-replica-id"] for response in (gone, kept)]
        try:
            wait_for(lambda: rows(cluster) == dict(Counter(on)), 5)
            gone.close()  # mid-stream, the rest unread
            freed_in = wait_for(lambda: rows(cluster) == {on[1]: 1}, 2)
            assert not ended, "the other stream ended first: this row may have ended on its own"
        finally:
            stop.set()
            reader.join()
            kept.close()
    wait_for(lambda: not any(busy(cluster).values()), 2)
    print(f"{model}: the row was freed {freed_in:.2f}s after the disconnect (the replica reports every <= 0.5s)")


# --- auth and registration switches -------------------------------------------------------------


def test_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.delenv("LORA_SERVE_API_KEY", raising=False)
    assert AppArgs().api_key is None
    monkeypatch.setenv("LORA_SERVE_API_KEY", "")
    assert AppArgs().api_key is None
    monkeypatch.setenv("LORA_SERVE_API_KEY", "from-env")
    assert AppArgs().api_key == "from-env"
    assert AppArgs(api_key="explicit").api_key == "explicit"
    assert AppArgs(**AppArgs().model_dump()).api_key == "from-env"  # what the deployments receive


@pytest.fixture(scope="module")
def locked(cluster):
    """The app redeployed with an API key, adapter registration off and the engine in its own process (runs last:
    it changes the cluster), once its new replicas have replaced the old ones."""
    before = set(cluster.replicas())
    cluster.deploy(replicas=CLUSTER_REPLICAS, wait_replicas=False, api_key=KEY, allow_adapter_registration=False,
                   engine_process=True)
    headers = {"authorization": f"Bearer {KEY}"}

    def serving_locked() -> bool:
        try:
            if HTTP.get(f"{cluster.url}/v1/models", timeout=10).status_code != 401:
                return False
            view = cluster.replicas(headers)
            return len(view) == CLUSTER_REPLICAS and not set(view) & before
        except httpx.HTTPError:
            return False

    wait_for(serving_locked, 180, poll_s=0.5)
    return headers


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/v1/debug/replicas"), ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/pirate"),
          ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/tokenize"),
          ("POST", "/detokenize"),
          ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/no-such-route")]
WRONG_AUTH = [None, "", "Bearer", "Bearer wrong-key", f"Bearer {KEY}x", f"Basic {KEY}", KEY,
              f"Bearer  {KEY} extra"]


def test_every_route_but_health_needs_the_key(cluster, locked):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        for method, path in ROUTES:
            for auth in WRONG_AUTH:
                headers = {"authorization": auth} if auth is not None else {}
                response = client.request(method, path, headers=headers, json=completion())
                assert response.status_code == 401, (method, path, auth, response.text)
                assert assert_openai_error(response)["code"] == "invalid_api_key"
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
        two = httpx.Headers([("authorization", f"Bearer {KEY}"), ("authorization", "Bearer wrong")])
        response = client.get("/v1/models", headers=two)
        assert response.status_code == 400 and "more than one Authorization" in assert_openai_error(response)["message"]
        tokens = client.post("/tokenize", headers=locked, json={"model": "pirate", "prompt": PROMPT}).json()["tokens"]
        assert PROMPT in client.post("/detokenize", headers=locked, json={"model": "base", "tokens": tokens}).text
    assert_healthy(cluster, headers=locked)


def test_openai_client_with_the_key(cluster, locked):
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert "pirate" in {m.id for m in oai.models.list().data}
    assert oai.completions.create(model="pirate", prompt=PROMPT, max_tokens=4).choices[0].text is not None
    streamed = list(oai.chat.completions.create(model="robot", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True))
    assert streamed and streamed[-1].choices[0].finish_reason in ("stop", "length")
    wrong = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.body["code"] == "invalid_api_key"


def test_adapter_registration_switched_off_is_403(cluster, locked, demo_dir):
    registered = HTTP.post(f"{cluster.url}/v1/adapters", headers=locked, timeout=30,
                            json={"name": "late", "path": f"{demo_dir}/adapters/pirate"})
    assert registered.status_code == 403, registered.text
    assert assert_openai_error(registered)["code"] == "adapter_registration_disabled"
    deleted = HTTP.delete(f"{cluster.url}/v1/adapters/pirate", headers=locked, timeout=30)
    assert deleted.status_code == 403, deleted.text
    assert assert_openai_error(deleted)["code"] == "adapter_registration_disabled"
    for route, body in [("load_lora_adapter", {"lora_name": "late", "lora_path": f"{demo_dir}/adapters/pirate"}),
                        ("unload_lora_adapter", {"lora_name": "pirate"})]:
        refused = HTTP.post(f"{cluster.url}/v1/{route}", headers=locked, timeout=30, json=body)
        assert refused.status_code == 403, refused.text
        assert assert_openai_error(refused)["code"] == "adapter_registration_disabled"
    served = HTTP.post(f"{cluster.url}/v1/completions", headers=locked, timeout=60,
                        json={"model": "pirate", "prompt": PROMPT, "max_tokens": 4})
    assert served.status_code == 200, served.text


def test_engine_in_its_own_process_serves_the_same_text(cluster, locked, demo_dir):
    """engine_process=True (app/engine/process.py), reached by a rolling update: the text is the engine-alone text,
    streamed or not, and the replicas report as before."""
    oai = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    for model, text in expected_texts(demo_dir, demo_adapters(demo_dir)).items():
        assert oai.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text == text
        streamed = "".join(c.choices[0].text for c in oai.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
        assert streamed == text, model
    reports = cluster.replicas(locked).values()
    assert reports and all(r["invariants"] == "ok" for r in reports)
    assert sum(r["step_timing"]["decode"]["steps"] for r in reports) > 0
