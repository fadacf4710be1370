"""Runtime adapter registration end to end: one answer per name, no request served with replaced weights, and
adapters registered from an S3-protocol store (moto's server, a real process) served with their local tokens."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from store_helpers import S3_ENV, MotoServer
from web import HTTP

PROMPT = "Tell me a story."
CLUSTER_ARGS = None  # deployed by the `cluster` fixture below, with an s3:// root beside the demo's folder


@pytest.fixture(scope="module")
def store(monkeypatch_module):
    """The store's endpoint and keys in this process's environment; the app gets them in its own (`cluster`)."""
    server = MotoServer()
    server.use(monkeypatch_module)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bucket(store, demo_dir):
    bucket = store.bucket()
    for name in ("pirate", "robot"):
        bucket.put_folder(demo_dir / "adapters" / name, f"demo/{name}")
    return bucket


@pytest.fixture(scope="module")
def cluster(bucket, cluster, demo_dir, tmp_path_factory):
    env = {name: os.environ[name] for name in S3_ENV}
    cluster.deploy(replicas=2, env=env, adapter_roots=[str(demo_dir / "adapters"), bucket.uri("demo")],
                   adapter_cache_dir=str(tmp_path_factory.mktemp("node-cache")))
    return cluster


def complete(cluster, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    return HTTP.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


def register(cluster, name, path):
    return HTTP.post(f"{cluster.url}/v1/adapters", json={"name": name, "path": path}, timeout=60)


def texts(cluster) -> dict:
    return {name: complete(cluster, name).json()["choices"][0]["text"] for name in ("pirate", "robot")}


class Stream(threading.Thread):
    """A long greedy completion on `model`, read as it comes; stop() drops the connection."""

    def __init__(self, cluster, model):
        super().__init__(daemon=True)
        self.cluster, self.model = cluster, model
        self.text, self.finished = "", False
        self.started, self.halt = threading.Event(), threading.Event()

    def run(self):
        # As many tokens as the demo's context holds past the prompt: the stream outlasts the test's checks.
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with HTTP.stream("POST", f"{self.cluster.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if self.halt.is_set():
                    return
                if line.startswith("data: {"):
                    self.text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                    self.started.set()
        self.finished = True

    def stop(self):
        self.halt.set()
        self.join(30)


def test_name_registered_again_while_streaming_never_serves_the_old_weights(cluster, demo_dir):
    expected = texts(cluster)
    assert expected["pirate"] != expected["robot"]
    assert register(cluster, "swap", "pirate").status_code == 201
    stream = Stream(cluster, "swap")
    stream.start()
    try:
        assert stream.started.wait(60)
        time.sleep(1.0)
        assert HTTP.delete(f"{cluster.url}/v1/adapters/swap").status_code == 200
        created = register(cluster, "swap", "robot")
        assert created.status_code == 201, created.text
        roots = {m["id"]: m["root"] for m in HTTP.get(f"{cluster.url}/v1/models").json()["data"]}
        assert roots["swap"].endswith("/robot")
        during = [complete(cluster, "swap") for _ in range(8)]
        assert not stream.finished, "the stream ended before the checks: they tested nothing"
        for response in during:  # robot's text, or refused while this replica's requests still use pirate's
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "engine_unavailable"
                assert response.headers.get("retry-after") == "1"
            else:
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == expected["robot"]
    finally:
        stream.stop()
    assert stream.text.startswith(expected["pirate"])  # the running stream kept the weights it started with
    deadline = time.time() + 10
    after = []
    while time.time() < deadline and len(after) < 8:
        response = complete(cluster, "swap")
        if response.status_code == 200:
            after.append(response.json()["choices"][0]["text"])
        else:
            assert response.status_code == 503, response.text
            time.sleep(0.2)
    assert after == [expected["robot"]] * 8, after
    assert HTTP.delete(f"{cluster.url}/v1/adapters/swap").status_code == 200


def test_concurrent_registrations_of_one_name_get_one_success(cluster, demo_dir):
    paths = ["pirate", "robot"]
    for trial in range(3):
        name = f"race-{trial}"

        def post(i):
            time.sleep(0.002 * i)
            return register(cluster, name, paths[i % 2])

        with ThreadPoolExecutor(40) as pool:
            responses = list(pool.map(post, range(40)))
        created = [i for i, r in enumerate(responses) if r.status_code == 201]
        assert len(created) == 1, [r.status_code for r in responses]
        refused = [r for r in responses if r.status_code != 201]
        assert all(r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists" for r in refused), \
            {r.status_code for r in refused}
        roots = {m["id"]: m["root"] for m in HTTP.get(f"{cluster.url}/v1/models").json()["data"]}
        assert roots[name].endswith("/" + paths[created[0] % 2])
        assert HTTP.delete(f"{cluster.url}/v1/adapters/{name}").status_code == 200


def node_downloads(cluster, settle_s: float = 3.0) -> int:
    """Downloads into the node cache, summed over the replicas' reports once they stop changing (each report is
    up to 0.5 s old)."""
    last, deadline = None, time.time() + settle_s
    while time.time() < deadline:
        now = sum(r["node_cache"]["downloads"] for r in cluster.replicas().values())
        if now == last and now > 0:
            return now
        last = now
        time.sleep(0.6)
    return last


def test_adapter_from_s3_serves_its_local_tokens(cluster, bucket):
    expected = texts(cluster)
    created = register(cluster, "pirate-s3", bucket.uri("demo", "pirate"))
    assert created.status_code == 201, created.text
    assert created.json()["root"] == bucket.uri("demo", "pirate")
    assert complete(cluster, "pirate-s3").json()["choices"][0]["text"] == expected["pirate"]
    streamed = HTTP.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "model": "pirate-s3", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True})
    chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(httpx.Response(200, content=c).json()["choices"][0]["text"] for c in chunks) == expected["pirate"]
    assert node_downloads(cluster) == 1  # one download, though both replicas may have read it: they share it
    # Outside the roots, missing, or carrying credentials: refused by name, nothing fetched.
    for path, status, code in ((bucket.uri("elsewhere", "pirate"), 400, "adapter_path_outside_roots"),
                               (bucket.uri("demo", "nobody"), 404, "adapter_source_not_found"),
                               ("s3://key:secret@" + bucket.uri("demo", "pirate")[5:], 400, "adapter_format")):
        refused = register(cluster, "refused", path)
        assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), refused.text


def test_store_down_fails_only_the_adapters_the_node_does_not_hold(cluster, bucket, store):
    """Last in the module: it stops the store."""
    expected = texts(cluster)
    assert register(cluster, "robot-s3", bucket.uri("demo", "robot")).status_code == 201
    assert complete(cluster, "pirate-s3").json()["choices"][0]["text"] == expected["pirate"]  # on the node
    store.stop()
    failed = complete(cluster, "robot-s3")
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "adapter_load_failed" and "robot" in failed.json()["error"]["message"]
    assert int(failed.headers["retry-after"]) >= 1
    assert complete(cluster, "pirate-s3").json()["choices"][0]["text"] == expected["pirate"]
    assert texts(cluster) == expected
    assert all(r["invariants"] == "ok" for r in cluster.replicas().values())
