"""Traffic for the cluster tests: clients that send requests back to back over every adapter,
streaming and not, until told to stop or their deadline passes, and check each output against the
text the adapter gives alone (the engine without Ray)."""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.engine.config import EngineConfig
from app.engine.engine import LLMEngine
from app.sampling.params import SamplingParams
from bench.common import completion_stream_text
from engine_helpers import TEST_HOST_CACHE_BYTES
from web import HTTP

PROMPT = "Tell me a story."
MAX_TOKENS = 12


def demo_adapters(demo_dir) -> dict[str, str]:
    manifest = json.loads((Path(demo_dir) / "demo.json").read_text())
    return {a["name"]: str(Path(demo_dir) / a["path"]) for a in manifest["adapters"]}


def expected_texts(demo_dir, adapters: dict[str, str], max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    """Greedy text of every adapter and the base model, from the engine alone. Greedy decoding is deterministic, so
    each set of adapters is decoded once per session, however many modules ask for it."""
    return dict(_engine_texts(str(demo_dir), tuple(adapters.items()), max_tokens))


@functools.cache
def _engine_texts(demo_dir: str, adapters: tuple[tuple[str, str], ...], max_tokens: int) -> dict[str, str]:
    adapters = dict(adapters)
    roots = tuple(sorted({str(Path(p).parent) for p in adapters.values()}))
    engine = LLMEngine(EngineConfig(base_model=f"{demo_dir}/base", adapter_roots=roots, device="cpu",
                                    dtype="float32", num_slots=8, host_cache_bytes=TEST_HOST_CACHE_BYTES))
    out = {}
    try:
        for name in [None, *adapters]:
            if name:
                engine.register_adapter(name, adapters[name])
            request = engine.add_request(PROMPT, name, SamplingParams(max_tokens=max_tokens, temperature=0))
            text = ""
            while engine.has_work():
                text += "".join(o.text for o in engine.step() if o.request_id == request.request_id)
            out[name or "base"] = text
    finally:
        engine.shutdown()
    return out


@dataclass
class Outcome:
    model: str
    stream: bool
    status: str  # "200", another HTTP status, "stream:<error code>" or the client exception's name
    ok: bool  # 200 and exactly the expected text
    replica: str | None
    started: float  # time.monotonic()
    ended: float
    detail: str = ""


def request_once(client: httpx.Client, model: str, stream: bool, expected: str, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    started = time.monotonic()
    try:
        response = client.post("/v1/completions", json=body)
        replica = response.headers.get("x-replica-id")
        if response.status_code != 200:
            return Outcome(model, stream, str(response.status_code), False, replica, started, time.monotonic(),
                           response.text[:200])
        if not stream:
            text = response.json()["choices"][0]["text"]
            return Outcome(model, stream, "200", text == expected, replica, started, time.monotonic(), text)
        text, error = completion_stream_text(response.text)
        status = "200" if error is None else f"stream:{error}"
        ok = status == "200" and text == expected and response.text.endswith("data: [DONE]\n\n")
        return Outcome(model, stream, status, ok, replica, started, time.monotonic(), text)
    except httpx.HTTPError as e:
        return Outcome(model, stream, type(e).__name__, False, None, started, time.monotonic(), repr(e)[:200])


class Traffic:
    """`clients` threads sending requests back to back; every other request streams."""

    def __init__(self, url: str, expected: dict[str, str], clients: int, deadline_s: float = 240,
                 max_tokens: int = MAX_TOKENS, timeout_s: float = 60, headers: dict | None = None):
        self.url, self.expected, self.max_tokens = url, expected, max_tokens
        self.timeout = httpx.Timeout(timeout_s)
        self.headers = headers or {}
        self.models = sorted(expected)
        self.results: list[Outcome] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + deadline_s
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, index: int) -> None:
        i = index
        with httpx.Client(base_url=self.url, timeout=self.timeout, headers=self.headers) as client:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                model = self.models[i % len(self.models)]
                self.results.append(request_once(client, model, i % 2 == 1, self.expected[model], self.max_tokens))
                i += 1

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 90) -> list[Outcome]:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._threads)
        assert not stuck, f"{stuck} client threads still waiting {timeout_s}s after the traffic stopped"
        return self.results

    def failures(self, since: float = 0.0) -> list[Outcome]:
        return [o for o in self.results if not o.ok and o.started >= since]


def wait_for(predicate, timeout_s: float, poll_s: float = 0.25, what: str = "condition"):
    """Poll until predicate() is truthy; return its value. Exceptions in predicate count as false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (httpx.HTTPError, KeyError, ValueError):
            value = None
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not true within {timeout_s}s")


def replica_view(url: str, headers: dict | None = None) -> dict:
    response = HTTP.get(f"{url}/v1/debug/replicas", timeout=10, headers=headers)
    return response.json()["replicas"] if response.status_code == 200 else {}
