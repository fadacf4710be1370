"""Runtime adapter registration end to end: one answer per name, and no request served with replaced weights."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPT = "Tell me a story."


def complete(cluster, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


def register(cluster, name, path):
    return httpx.post(f"{cluster.url}/v1/adapters", json={"name": name, "path": path}, timeout=60)


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
        with httpx.stream("POST", f"{self.cluster.url}/v1/completions", json=body, timeout=120) as response:
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
        assert httpx.delete(f"{cluster.url}/v1/adapters/swap").status_code == 200
        created = register(cluster, "swap", "robot")
        assert created.status_code == 201, created.text
        roots = {m["id"]: m["root"] for m in httpx.get(f"{cluster.url}/v1/models").json()["data"]}
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
    assert httpx.delete(f"{cluster.url}/v1/adapters/swap").status_code == 200


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
        roots = {m["id"]: m["root"] for m in httpx.get(f"{cluster.url}/v1/models").json()["data"]}
        assert roots[name].endswith("/" + paths[created[0] % 2])
        assert httpx.delete(f"{cluster.url}/v1/adapters/{name}").status_code == 200
