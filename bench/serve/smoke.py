"""Deploy the Serve app on this machine's Ray cluster and check it end to end under load.

    python -m bench.serve.smoke --replicas 1            # one GPU replica (or CPU)
    python -m bench.serve.smoke --replicas 2 --router serve_default
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray
from ray import serve

from app.demo.build import ensure_demo
from bench.common import REPO_DEMO, write_result
from deploy.app import make_app
from deploy.args import AppArgs


def wait_for_replicas(url: str, count: int, timeout_s: float = 600) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            view = httpx.get(f"{url}/v1/debug/replicas", timeout=5).json()["replicas"]
            if len(view) >= count:
                return view
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{count} replicas did not report within {timeout_s}s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--router", default="adapter_affinity", choices=["adapter_affinity", "serve_default"])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    demo = ensure_demo(REPO_DEMO / args.size, size=args.size)
    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app_args = AppArgs(base_model=str(demo / "base"), adapter_roots=[str(demo / "adapters")], build_demo=False,
                       num_slots=4, max_batch_size=16, router=args.router, max_input_tokens=512,
                       max_total_tokens=32768)
    started = time.time()
    serve.run(make_app(app_args, num_replicas=args.replicas), name="lora", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{args.port}"
    view = wait_for_replicas(url, args.replicas)
    ready_s = time.time() - started
    models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    base, adapters = models[0], models[1:]
    checks = {}
    with httpx.Client(timeout=300) as client:
        for model in models:
            body = {"model": model, "prompt": "Tell me a story.", "max_tokens": 16, "temperature": 0}
            whole = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
            chunks = []
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
            checks[model] = {"text": whole, "stream_equals": "".join(chunks) == whole}

    def one(i: int):
        model = adapters[i % len(adapters)] if i % 5 else base
        body = {"model": model, "prompt": "Tell me a story.", "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.perf_counter()
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        return response.status_code, time.perf_counter() - start, response.headers.get("x-replica-id")

    load_start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, range(args.requests)))
    elapsed = time.perf_counter() - load_start
    time.sleep(1.5)
    view = httpx.get(f"{url}/v1/debug/replicas").json()["replicas"]
    latencies = sorted(r[1] for r in results)
    summary = {
        "replicas": args.replicas, "router": args.router, "size": args.size, "ready_seconds": ready_s,
        "devices": sorted({v.get("device") for v in view.values()}),
        "statuses": {str(c): sum(r[0] == c for r in results) for c in {r[0] for r in results}},
        "requests_per_s": len(results) / elapsed, "tokens_per_s": len(results) * args.max_tokens / elapsed,
        "latency_p50_s": statistics.median(latencies), "latency_p99_s": latencies[int(0.99 * (len(latencies) - 1))],
        "served_by": {uid: sum(r[2] == uid for r in results) for uid in view},
        "arrivals": {uid: v["arrivals"] for uid, v in view.items()},
        "hint_lead": {uid: v["hint_lead_seconds"] for uid, v in view.items()},
        "checks": checks,
    }
    print(summary)
    print("wrote", write_result(f"serve-smoke-{args.size}-{args.replicas}rep-{args.router}", summary))
    serve.shutdown()


if __name__ == "__main__":
    main()
