"""The bad input table of test_hardening.py: one Case per malformed or out-of-range request, with the status
(and, where it matters, the error code) it must get."""

import json
from dataclasses import dataclass, field

import httpx

from app.api.schemas import MAX_TOKENS_LIMIT

PROMPT = "Tell me a story."


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
    Case("no model", 400, without(completion(), "model")),  # as OpenAI answers
    Case("no prompt", 422, without(completion(), "prompt")),
    Case("negative max_tokens", 422, completion(max_tokens=-1)),
    Case("zero max_tokens", 422, completion(max_tokens=0)),
    Case("max_tokens past the schema limit", 422, completion(max_tokens=MAX_TOKENS_LIMIT + 1)),
    Case("max_tokens 10**30", 422, completion(max_tokens=10**30)),
    Case("max_tokens 1e308", 422, completion(max_tokens=1e308)),
    Case("max_tokens past the KV budget", 400, completion(max_tokens=MAX_TOKENS_LIMIT), code="invalid_request"),
    Case("max_tokens past the model's context", 400, completion(max_tokens=3000, ignore_eos=True),
         code="invalid_request"),
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
    Case("chat no model", 400, without(chat(), "model"), chat=True),
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
    Case("chat schema keyword the grammar does not enforce", 400, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "multipleOf": 7}}}),
         chat=True, code="invalid_response_format"),
    Case("chat schema with no finite instance", 400, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}), chat=True,
         code="invalid_response_format"),
    Case("chat unknown field", 400, chat(echo=True), chat=True, code="unsupported_parameter"),
]
