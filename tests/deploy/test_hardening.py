"""Hardening over HTTP: bad input, fuzzing, client disconnects and auth, on a local 2-replica cluster.

Status choices, where OpenAI leaves room:
- A body that is not a JSON object (bad JSON, bad UTF-8, another content type) is 400; a JSON object
  with a field of the wrong type, range or presence is 422 (pydantic at the edge).
- max_tokens past MAX_TOKENS_LIMIT (2**20) is 422; within it but past the KV budget
  (prompt + max_tokens > max_total_tokens) it is 400 invalid_request.
- A prompt of control characters is valid text: 200.
"""

import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import MAX_TOKENS_LIMIT
from deploy.args import AppArgs

PROMPT = "Tell me a story."
KEY = "secret-key"
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
    assert httpx.get(f"{cluster.url}/health", timeout=10).json() == {"status": "ok"}
    done = httpx.post(f"{cluster.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": "base", "prompt": PROMPT, "max_tokens": 4})
    assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"], done.text
    chat = httpx.post(f"{cluster.url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": "pirate", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text


# --- the bad input table ------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    status: int
    body: object = None  # sent as ASCII JSON (lone surrogates escaped) unless `content` is given
    content: bytes | None = None
    headers: dict = field(default_factory=dict)
    chat: bool = False
    code: str | None = None  # the error's expected code, where it matters
    chunked: bool = False  # send `content` without a Content-Length

    def send(self, client: httpx.Client) -> httpx.Response:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        if self.content is not None:
            content = iter([self.content]) if self.chunked else self.content
            return client.post(path, content=content, headers=self.headers)
        return client.post(path, content=json.dumps(self.body).encode(),
                           headers={"content-type": "application/json", **self.headers})


def completion(**kw) -> dict:
    return {"model": "base", "prompt": PROMPT, "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


CONTROL = "".join(map(chr, range(32))) + "\x7f\x1b[31m\u200b\ufeff"

BAD_INPUT = [
    # --- /v1/completions -----------------------------------------------------------------------
    Case("malformed JSON", 400, content=b'{"model": "base", "prompt": ', headers={"content-type": "application/json"}),
    Case("JSON array body", 400, body=[completion()]),
    Case("JSON string body", 400, body="hello"),
    Case("JSON null body", 400, content=b"null", headers={"content-type": "application/json"}),
    Case("empty body", 422, content=b"", headers={"content-type": "application/json"}),
    Case("NaN literal", 422, content=b'{"model": "base", "prompt": "x", "temperature": NaN}',
         headers={"content-type": "application/json"}),
    Case("invalid UTF-8", 400, content=b'{"model": "base", "prompt": "caf\xe9 \xff\xfe"}',
         headers={"content-type": "application/json"}),
    Case("text/plain content type", 400, content=json.dumps(completion()).encode(),
         headers={"content-type": "text/plain"}),
    Case("form content type", 400, content=b"model=base&prompt=hi",
         headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("max_tokens a string", 422, completion(max_tokens="many")),
    Case("max_tokens a float", 422, completion(max_tokens=2.5)),
    Case("temperature a string", 422, completion(temperature="hot")),
    Case("prompt a number", 422, completion(prompt=5)),
    Case("prompt a nested object", 422, completion(prompt={"text": {"deep": [1, 2]}})),
    Case("prompt a list of strings", 200, completion(prompt=["a", "b"])),
    Case("prompt a list of token-id lists", 200, completion(prompt=[[1, 2], [3]])),
    Case("prompt mixing strings and ids", 422, completion(prompt=["a", 1])),
    Case("token ids as booleans", 422, completion(prompt=[True, False])),
    Case("token ids as floats", 422, completion(prompt=[1.0, 2.0])),
    Case("too many prompts", 422, completion(prompt=["a"] * 33)),
    Case("model a number", 422, completion(model=5)),
    Case("model null", 422, completion(model=None)),
    Case("stop a number", 422, completion(stop=5)),
    Case("stream_options a list", 422, completion(stream_options=[1])),
    Case("no model", 422, without(completion(), "model")),
    Case("no prompt", 422, without(completion(), "prompt")),
    Case("negative max_tokens", 422, completion(max_tokens=-1)),
    Case("zero max_tokens", 422, completion(max_tokens=0)),
    Case("max_tokens past the schema limit", 422, completion(max_tokens=MAX_TOKENS_LIMIT + 1)),
    Case("max_tokens 10**30", 422, completion(max_tokens=10**30)),
    Case("max_tokens 1e308", 422, completion(max_tokens=1e308)),
    Case("max_tokens past the KV budget", 400, completion(max_tokens=MAX_TOKENS_LIMIT), code="invalid_request"),
    Case("negative temperature", 422, completion(temperature=-0.1)),
    Case("temperature above 2", 422, completion(temperature=2.5)),
    Case("temperature 1e-30", 200, completion(temperature=1e-30)),
    Case("temperature 1e-300", 200, completion(temperature=1e-300, top_p=1e-300, top_k=10**30)),
    Case("top_p zero", 422, completion(top_p=0)),
    Case("top_p above 1", 422, completion(top_p=1.5)),
    Case("top_k below -1", 422, completion(top_k=-2)),
    Case("negative seed", 422, completion(seed=-1)),
    Case("seed 2**64", 422, completion(seed=2**64)),
    Case("empty prompt", 422, completion(prompt="")),
    Case("empty token list", 422, completion(prompt=[])),
    Case("negative token id", 422, completion(prompt=[1, -1])),
    Case("token id past the vocabulary", 400, completion(prompt=[1, 10**6]), code="invalid_request"),
    Case("token id 10**30", 422, completion(prompt=[1, 10**30])),
    Case("prompt past the token limit", 400, completion(prompt="word " * 400), code="context_length_exceeded"),
    Case("token ids past the token limit", 400, completion(prompt=[5] * 300), code="context_length_exceeded"),
    Case("lone surrogate in prompt", 422, completion(prompt="a\ud800b")),
    Case("lone surrogate in stop", 422, completion(stop=["\udfff"])),
    Case("control-character prompt", 200, completion(prompt=CONTROL)),
    Case("unknown model", 404, completion(model="no-such-adapter"), code="adapter_not_found"),
    Case("empty model", 404, completion(model="")),
    Case("model with /", 404, completion(model="pirate/../robot"), code="model_not_found"),
    Case("model with ..", 404, completion(model=".."), code="model_not_found"),
    Case("model with NUL", 404, completion(model="pirate\x00"), code="model_not_found"),
    Case("model with a lone surrogate", 422, completion(model="pirate\ud800")),
    Case("model name too long", 422, completion(model="m" * 300)),
    Case("body over the size limit", 413, completion(prompt="x" * 70000), code="request_too_large"),
    Case("chunked body over the size limit", 413, content=json.dumps(completion(prompt="x" * 70000)).encode(),
         headers={"content-type": "application/json"}, chunked=True, code="request_too_large"),
    Case("stop list too long", 422, completion(stop=[f"s{i}" for i in range(9)])),
    Case("empty stop string", 400, completion(stop=[""]), code="invalid_request"),
    Case("stop string too long", 400, completion(stop=["s" * 300]), code="invalid_request"),
    Case("n = 2", 200, completion(n=2)),
    Case("n past the limit", 422, completion(n=17)),
    Case("echo", 200, completion(echo=True)),
    Case("echo with max_tokens 0", 200, completion(echo=True, logprobs=1, max_tokens=0)),
    Case("logprobs", 200, completion(logprobs=5)),
    Case("logprobs past 20", 422, completion(logprobs=21)),
    Case("suffix", 400, completion(suffix="end"), code="unsupported_parameter"),
    Case("best_of above n", 400, completion(best_of=2), code="unsupported_parameter"),
    Case("unknown field", 400, completion(guided_regex="a+"), code="unsupported_parameter"),
    Case("penalties", 200, completion(presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.3, min_tokens=2,
                                      stop_token_ids=[5], logit_bias={"7": 5})),
    Case("presence_penalty out of range", 422, completion(presence_penalty=3)),
    Case("logit_bias key not a token id", 422, completion(logit_bias={"a": 1})),
    Case("logit_bias id past the vocabulary", 400, completion(logit_bias={"5000": 1}), code="invalid_request"),
    Case("stop_token_ids id past the vocabulary", 400, completion(stop_token_ids=[5000]), code="invalid_request"),
    Case("min_tokens above max_tokens", 200, completion(min_tokens=10)),
    Case("streamed unknown model", 404, completion(model="no-such-adapter", stream=True)),
    Case("streamed prompt past the token limit", 400, completion(prompt="word " * 400, stream=True),
         code="context_length_exceeded"),
    # --- /v1/chat/completions ------------------------------------------------------------------
    Case("chat malformed JSON", 400, content=b'{"model": "base", "messages": [', chat=True,
         headers={"content-type": "application/json"}),
    Case("chat invalid UTF-8", 400, content=b'{"model": "base", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
         headers={"content-type": "application/json"}, chat=True),
    Case("chat text/plain content type", 400, content=json.dumps(chat()).encode(),
         headers={"content-type": "text/plain"}, chat=True),
    Case("chat no model", 422, without(chat(), "model"), chat=True),
    Case("chat no messages", 422, without(chat(), "messages"), chat=True),
    Case("chat empty messages", 422, chat(messages=[]), chat=True),
    Case("chat messages a string", 422, chat(messages="hi"), chat=True),
    Case("chat bad role", 422, chat(messages=[{"role": "wizard", "content": "hi"}]), chat=True),
    Case("chat role missing", 422, chat(messages=[{"content": "hi"}]), chat=True),
    Case("chat content missing", 422, chat(messages=[{"role": "user"}]), chat=True),
    Case("chat content a number", 422, chat(messages=[{"role": "user", "content": 5}]), chat=True),
    Case("chat content a nested object", 422, chat(messages=[{"role": "user", "content": {"a": {"b": 1}}}]),
         chat=True),
    Case("chat too many messages", 422, chat(messages=[{"role": "user", "content": "hi"}] * 257), chat=True),
    Case("chat lone surrogate", 422, chat(messages=[{"role": "user", "content": "\ud83d"}]), chat=True),
    Case("chat zero max_tokens", 422, chat(max_tokens=0), chat=True),
    Case("chat max_tokens past the KV budget", 400, chat(max_tokens=MAX_TOKENS_LIMIT), chat=True),
    Case("chat temperature out of range", 422, chat(temperature=3), chat=True),
    Case("chat top_p out of range", 422, chat(top_p=-1), chat=True),
    Case("chat top_k out of range", 422, chat(top_k=-7), chat=True),
    Case("chat prompt past the token limit", 400, chat(messages=[{"role": "user", "content": "word " * 400}]),
         chat=True, code="context_length_exceeded"),
    Case("chat control characters", 200, chat(messages=[{"role": "user", "content": CONTROL}]), chat=True),
    Case("chat unknown model", 404, chat(model="no-such-adapter"), chat=True, code="adapter_not_found"),
    Case("chat model with /", 404, chat(model="a/b"), chat=True, code="model_not_found"),
    Case("chat model with ..", 404, chat(model="..x"), chat=True, code="model_not_found"),
    Case("chat model with NUL", 404, chat(model="\x00"), chat=True, code="model_not_found"),
    Case("chat body over the size limit", 413, chat(messages=[{"role": "user", "content": "x" * 70000}]), chat=True),
    Case("chat stop list too long", 422, chat(stop=["a"] * 9), chat=True),
    Case("chat n = 2", 200, chat(n=2), chat=True),
    Case("chat logprobs", 200, chat(logprobs=True, top_logprobs=3), chat=True),
    Case("chat top_logprobs without logprobs", 400, chat(top_logprobs=3), chat=True, code="unsupported_parameter"),
    Case("chat text content parts", 200, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
         chat=True),
    Case("chat image content part", 400, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         chat=True, code="unsupported_parameter"),
    Case("chat tools", 400, chat(tools=[{"type": "function"}]), chat=True, code="unsupported_parameter"),
    Case("chat response_format json", 200, chat(response_format={"type": "json_object"}, max_tokens=4), chat=True),
    Case("chat response_format bad schema", 400, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}), chat=True,
         code="invalid_response_format"),
    Case("chat unknown field", 400, chat(echo=True), chat=True, code="unsupported_parameter"),
]


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
    """The app redeployed with an API key and adapter registration off (runs last: it changes the cluster)."""
    cluster.deploy(replicas=2, wait_replicas=False, api_key=KEY, allow_adapter_registration=False)
    headers = {"authorization": f"Bearer {KEY}"}

    def serving_locked() -> bool:
        try:
            if httpx.get(f"{cluster.url}/v1/models", timeout=10).status_code != 401:
                return False
            view = httpx.get(f"{cluster.url}/v1/debug/replicas", headers=headers, timeout=10)
            return view.status_code == 200 and len(view.json()["replicas"]) == 2
        except httpx.HTTPError:
            return False

    wait_for(serving_locked, 120, poll_s=0.5)
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
    registered = httpx.post(f"{cluster.url}/v1/adapters", headers=locked, timeout=30,
                            json={"name": "late", "path": f"{demo_dir}/adapters/pirate"})
    assert registered.status_code == 403, registered.text
    assert assert_openai_error(registered)["code"] == "adapter_registration_disabled"
    deleted = httpx.delete(f"{cluster.url}/v1/adapters/pirate", headers=locked, timeout=30)
    assert deleted.status_code == 403, deleted.text
    assert assert_openai_error(deleted)["code"] == "adapter_registration_disabled"
    for route, body in [("load_lora_adapter", {"lora_name": "late", "lora_path": f"{demo_dir}/adapters/pirate"}),
                        ("unload_lora_adapter", {"lora_name": "pirate"})]:
        refused = httpx.post(f"{cluster.url}/v1/{route}", headers=locked, timeout=30, json=body)
        assert refused.status_code == 403, refused.text
        assert assert_openai_error(refused)["code"] == "adapter_registration_disabled"
    served = httpx.post(f"{cluster.url}/v1/completions", headers=locked, timeout=60,
                        json={"model": "pirate", "prompt": PROMPT, "max_tokens": 4})
    assert served.status_code == 200, served.text
