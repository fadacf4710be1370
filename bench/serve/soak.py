"""Soak: minutes of mixed traffic against `make serve`'s app; errors by status, replica memory over time.

    python -m bench.serve.soak --launch --minutes 10     # what `make soak` runs

With --launch it starts `serve run serve_config.yaml` (the app `make serve` serves; only the port may
differ, --port) and stops it at the end; without it, it uses the app already at --url. Traffic, all
at once: clients sending completions back to back over every adapter and the base model, streaming
and not, each greedy output checked against the engine alone (the demo's adapters); a client that
registers a copy of a demo adapter, uses it and unregisters it; a client that opens long streams and
hangs up after a few chunks; and a few bad requests each second, each of which must get its own 4xx.
Every 5 s it records each replica's RSS, rows, queue, pins and host-cache bytes (GET /v1/debug/replicas).
Writes bench/results/<device>-soak.json and <device>-soak-rss.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from bench.common import REPO, RESULTS, completion_stream_text, device_slug, write_result

PROMPTS = ["Tell me a story.", "Hello!"]
MAX_TOKENS = 24
WARMUP_S = 120  # RSS before this is start-up and first loads, not a trend
BAD = [  # (name, body or raw bytes, expected status)
    ("unknown model", {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 4}, 404),
    ("max_tokens a string", {"model": "base", "prompt": "hi", "max_tokens": "many"}, 422),
    ("malformed JSON", b'{"model": "base", "prompt": ', 400),
    ("unsupported field", {"model": "pirate", "prompt": "hi", "suffix": "x"}, 400),
    ("prompt too long", {"model": "robot", "prompt": "word " * 700, "max_tokens": 4}, 400),
    ("temperature out of range", {"model": "base", "prompt": "hi", "temperature": 9}, 422),
]


class Soak:
    def __init__(self, url: str, seconds: float, clients: int, bad_per_s: float, expected: dict, demo_paths: dict):
        self.url, self.seconds, self.clients, self.bad_per_s = url, seconds, clients, bad_per_s
        self.expected, self.demo_paths = expected, demo_paths  # expected[(adapter, prompt)] = greedy text
        self.models = sorted({model for model, _ in expected})
        self.good = Counter()  # status -> count, for requests that should succeed
        self.bad = Counter()  # "name: status" -> count
        self.mismatches: list[dict] = []
        self.counts = Counter()
        self.samples: list[dict] = []
        self.rng = random.Random(0)

    # --- traffic ---------------------------------------------------------------------------------

    async def completion(self, client: httpx.AsyncClient, model: str, expected_of: str | None = None) -> None:
        prompt, stream = self.rng.choice(PROMPTS), self.rng.random() < 0.5
        max_tokens = self.rng.randint(4, MAX_TOKENS)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        try:
            response = await client.post("/v1/completions", json=body)
            status, text = str(response.status_code), ""
            if response.status_code == 200 and stream:
                text, error = completion_stream_text(response.text)
                if error is not None:
                    status = f"stream error {error}"
            elif response.status_code == 200:
                text = response.json()["choices"][0]["text"]
        except httpx.HTTPError as e:
            status, text = type(e).__name__, ""
        self.good[status] += 1
        self.counts["stream" if stream else "whole"] += 1
        want = self.expected.get((expected_of or model, prompt))
        if status == "200" and want is not None and not want.startswith(text):
            self.mismatches.append({"model": model, "prompt": prompt, "max_tokens": max_tokens, "text": text})

    async def client_loop(self, index: int, stop_at: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            i = index
            while time.monotonic() < stop_at:
                await self.completion(client, self.models[i % len(self.models)])
                i += 1

    async def registration_loop(self, stop_at: float) -> None:
        """Register a copy of a demo adapter under a new name, use it, unregister it; again and again."""
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            n = 0
            while time.monotonic() < stop_at:
                source = self.rng.choice(sorted(self.demo_paths))
                name = f"soak-{n}"
                n += 1
                created = await self._call(client, "POST", "/v1/adapters", {"name": name, "path": self.demo_paths[source]})
                self.good[f"register {created}"] += 1
                for _ in range(3):
                    await self.completion(client, name, expected_of=source)
                deleted = await self._call(client, "DELETE", f"/v1/adapters/{name}")
                self.good[f"unregister {deleted}"] += 1
                self.counts["registrations"] += 1
                await asyncio.sleep(1.0)

    async def cancel_loop(self, stop_at: float) -> None:
        """Long streams abandoned after a few chunks: each must free its row and slot pin."""
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            while time.monotonic() < stop_at:
                body = {"model": self.rng.choice(self.models), "prompt": PROMPTS[0], "max_tokens": 300,
                        "ignore_eos": True, "stream": True}
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        seen = 0
                        async for line in response.aiter_lines():
                            seen += line.startswith("data: {")
                            if seen >= 3:
                                break  # hang up mid-stream
                    self.good[f"cancelled {response.status_code}"] += 1
                except httpx.HTTPError as e:
                    self.good[f"cancelled {type(e).__name__}"] += 1
                self.counts["cancellations"] += 1
                await asyncio.sleep(0.5)

    async def bad_loop(self, stop_at: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            i = 0
            while time.monotonic() < stop_at:
                name, body, want = BAD[i % len(BAD)]
                i += 1
                try:
                    if isinstance(body, bytes):
                        response = await client.post("/v1/completions", content=body,
                                                     headers={"content-type": "application/json"})
                    else:
                        response = await client.post("/v1/completions", json=body)
                    status = response.status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.bad[f"{name}: {status}" + ("" if status == want else f" (expected {want})")] += 1
                await asyncio.sleep(1.0 / self.bad_per_s)

    async def _call(self, client, method: str, path: str, body: dict | None = None) -> str:
        try:
            return str((await client.request(method, path, json=body)).status_code)
        except httpx.HTTPError as e:
            return type(e).__name__

    # --- observation -----------------------------------------------------------------------------

    async def view(self, client: httpx.AsyncClient) -> dict:
        return (await client.get("/v1/debug/replicas")).json()["replicas"]

    async def sample_loop(self, started: float, stop_at: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while time.monotonic() < stop_at:
                try:
                    view = await self.view(client)
                    self.samples.append({"t_s": round(time.monotonic() - started, 1), "replicas": {
                        uid: {k: r.get(k) for k in ("rss_bytes", "running", "waiting", "pinned_slots",
                                                    "host_cache_bytes")} for uid, r in view.items()}})
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                await asyncio.sleep(5.0)

    async def run(self) -> dict:
        started = time.monotonic()
        stop_at = started + self.seconds
        await asyncio.gather(*[self.client_loop(i, stop_at) for i in range(self.clients)],
                             self.registration_loop(stop_at), self.cancel_loop(stop_at), self.bad_loop(stop_at),
                             self.sample_loop(started, stop_at))
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            deadline = time.monotonic() + 60  # rows and pins drain within a report period or two
            while True:
                final = await self.view(client)
                idle = all(r["running"] == 0 and r["waiting"] == 0 and r["pinned_slots"] == 0 for r in final.values())
                if idle or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        return {"elapsed_s": round(time.monotonic() - started, 1), "final": final, "models_at_end": models}


def expected_texts(demo_dir: Path) -> tuple[dict, dict]:
    """Greedy text of each demo adapter and the base model for each prompt, from the engine alone."""
    from app.engine.config import EngineConfig
    from app.engine.engine import LLMEngine
    from app.sampling.params import SamplingParams

    manifest = json.loads((demo_dir / "demo.json").read_text())
    paths = {a["name"]: str(demo_dir / a["path"]) for a in manifest["adapters"]}
    engine = LLMEngine(EngineConfig(base_model=str(demo_dir / "base"), adapter_roots=(str(demo_dir / "adapters"),),
                                    device="cpu", dtype="float32", num_slots=8))
    out = {}
    for name in [None, *paths]:
        if name:
            engine.register_adapter(name, paths[name])
        for prompt in PROMPTS:
            request = engine.add_request(prompt, name, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
            text = ""
            while engine.has_work():
                text += "".join(o.text for o in engine.step() if o.request_id == request.request_id)
            out[(name or "base", prompt)] = text
    engine.shutdown()
    return out, paths


def launch(port: int, folder: Path, log_path: Path) -> tuple[subprocess.Popen, int]:
    """`serve run serve_config.yaml` as `make serve` runs it, on `port`; returns it and its replica count."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    replicas = next(d.get("num_replicas", 1) for d in config["applications"][0]["deployments"]
                    if d["name"] == "LoRAReplica")
    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(path)], cwd=REPO, env=env,
                              stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return server, replicas


def wait_ready(url: str, server: subprocess.Popen | None, replicas: int = 1, timeout_s: float = 600) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"serve run exited with {server.returncode}")
        try:
            reporting = len(httpx.get(f"{url}/v1/debug/replicas", timeout=5).json()["replicas"])
            if reporting >= replicas:
                return reporting
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(2)
    raise TimeoutError(f"the app at {url} did not answer within {timeout_s}s")


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)  # serve run shuts the app and its local cluster down
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


def summarize(soak: Soak, outcome: dict, replicas_at_start: int) -> dict:
    rss: dict[str, list] = {}
    for sample in soak.samples:
        for uid, r in sample["replicas"].items():
            rss.setdefault(uid, []).append((sample["t_s"], r["rss_bytes"]))
    growth = {}
    for uid, series in rss.items():
        after = [b for t, b in series if t >= WARMUP_S]
        if len(after) >= 2:
            first, last, peak = after[0], after[-1], max(after)
            growth[uid] = {"after_warmup_mib": round(first / 2**20, 1), "end_mib": round(last / 2**20, 1),
                           "peak_mib": round(peak / 2**20, 1), "growth_mib": round((last - first) / 2**20, 1)}
    final = {uid: {k: r.get(k) for k in ("running", "waiting", "pinned_slots", "host_cache_bytes", "invariants",
                                          "rss_bytes")} for uid, r in outcome["final"].items()}
    bad_total = sum(soak.bad.values())
    bad_wrong = {k: v for k, v in soak.bad.items() if "expected" in k}
    good_errors = {k: v for k, v in soak.good.items() if k.split()[-1] not in ("200", "201")}
    return {"seconds": outcome["elapsed_s"], "replicas": replicas_at_start, "clients": soak.clients,
            "requests": dict(soak.counts), "good_by_status": dict(soak.good), "good_errors": good_errors,
            "bad_by_status": dict(soak.bad), "bad_total": bad_total, "bad_wrong_status": bad_wrong,
            "mismatched_outputs": soak.mismatches[:20], "mismatched_count": len(soak.mismatches),
            "rss_after_warmup": growth, "final": final, "models_at_end": outcome["models_at_end"],
            "samples": soak.samples}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    series: dict[str, list] = {}
    for sample in result["samples"]:
        for uid, r in sample["replicas"].items():
            series.setdefault(uid, []).append((sample["t_s"] / 60, r["rss_bytes"] / 2**20))
    for uid, points in sorted(series.items()):
        ax.plot(*zip(*points), label=f"replica {uid}")
    ax.axvline(WARMUP_S / 60, color="gray", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"soak: replica RSS, {result['seconds'] / 60:.0f} min of mixed traffic ({result['device']})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--launch", action="store_true", help="start `serve run serve_config.yaml` here")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--url", default=None, help="default: http://127.0.0.1:<port>")
    parser.add_argument("--clients", type=int, default=6, help="clients sending completions back to back")
    parser.add_argument("--bad-per-s", type=float, default=3.0)
    parser.add_argument("--demo-dir", default=str(REPO / "demo" / "tiny"))
    parser.add_argument("--results-dir", default=str(RESULTS))
    args = parser.parse_args()
    url = args.url or f"http://127.0.0.1:{args.port}"
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    server, replicas, folder = None, 1, tempfile.TemporaryDirectory(prefix="soak")
    try:
        if args.launch:
            server, replicas = launch(args.port, Path(folder.name), results_dir / "soak-serve.log.tmp")
        replicas = wait_ready(url, server, replicas)
        expected, demo_paths = expected_texts(Path(args.demo_dir))
        print(f"soak: {args.minutes} min against {url} ({replicas} replicas)", flush=True)
        soak = Soak(url, args.minutes * 60, args.clients, args.bad_per_s, expected, demo_paths)
        outcome = asyncio.run(soak.run())
    finally:
        if server is not None:
            stop(server)
        folder.cleanup()
    result = summarize(soak, outcome, replicas)
    path = write_result("soak", result, results_dir)
    result["device"] = json.loads(path.read_text())["device"]
    png = results_dir / f"{device_slug()}-soak-rss.png"
    plot(result, png)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
