"""Ray Serve's overhead: the same requests, one at a time, through HTTP + Serve and to the engine alone.

    python -m bench.serve.overhead --size tiny --requests 100                # HAProxy -> ingress, as `make serve`
    python -m bench.serve.overhead --size tiny --requests 100 --serve-proxy  # Serve's proxy, as a bare `serve run`

TTFT through Serve (streaming, time to the first SSE chunk) minus TTFT of the engine called in
process (time from add_request to the first token) is what the HTTP proxy, the ingress, the router
and the replica hop add to a request that never waits. Each stream is read to its end, as the engine
alone runs each request to completion: otherwise the next request would share the engine with this
one's remaining tokens and its cancellation (`--hang-up` measures that case).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx

from app.demo.build import ensure_demo
from app.engine.engine import LLMEngine
from app.sampling.params import SamplingParams
from bench.common import REPO_DEMO, write_result
from bench.serve.cluster import engine_loop
from bench.serve.load import launch
from deploy.haproxy import HAPROXY_ENV

PROMPT = "Tell me a story."


def engine_ttft(engine: LLMEngine, adapter: str | None) -> float:
    start = time.perf_counter()
    request = engine.add_request(PROMPT, adapter, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    first = None
    while engine.has_work():
        for output in engine.step():
            if first is None and output.request_id == request.request_id:
                first = time.perf_counter() - start
    return first


def http_ttft(client: httpx.Client, url: str, model: str, hang_up: bool = False) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    start, first = time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
                if hang_up:
                    break
    if first is None:
        raise RuntimeError("no token came back")
    return first


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--hang-up", action="store_true", help="close each stream at its first token")
    parser.add_argument("--serve-proxy", action="store_true", help="HTTP through Serve's proxy (a bare `serve run`), "
                        "not HAProxy straight to the ingress (`make serve`)")
    parser.add_argument("--app-args", default="{}", help='more AppArgs as JSON, e.g. \'{"engine_process": true}\'')
    args = parser.parse_args()
    demo = ensure_demo(REPO_DEMO / args.size, size=args.size)
    adapter = json.loads((demo / "demo.json").read_text())["adapters"][0]["name"]

    from app.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(base_model=str(demo / "base"), adapter_roots=(str(demo / "adapters"),)))
    engine.register_adapter(adapter, str(demo / "adapters" / adapter))
    for _ in range(5):
        engine_ttft(engine, adapter)
    alone = [engine_ttft(engine, adapter) for _ in range(args.requests)]
    engine.shutdown()
    del engine

    launch_args = argparse.Namespace(size=args.size, port=args.port, slots=4, batch=16, app_args=args.app_args,
                                     serve_proxy=args.serve_proxy)
    url = launch(launch_args, replicas=1, router="adapter_affinity")
    with httpx.Client(timeout=60) as client:
        for _ in range(5):
            http_ttft(client, url, adapter, args.hang_up)
        served = [http_ttft(client, url, adapter, args.hang_up) for _ in range(args.requests)]
    result = {
        "size": args.size, "requests": args.requests, "hang_up": args.hang_up, "app_args": json.loads(args.app_args),
        "engine_ttft_ms_p50": 1e3 * statistics.median(alone), "serve_ttft_ms_p50": 1e3 * statistics.median(served),
        "engine_ttft_ms_mean": 1e3 * statistics.fmean(alone), "serve_ttft_ms_mean": 1e3 * statistics.fmean(served),
    }
    result["serve_overhead_ms_p50"] = result["serve_ttft_ms_p50"] - result["engine_ttft_ms_p50"]
    print(result)
    # What launch chose: without an HAProxy binary here it falls back to Serve's proxy.
    result["http_path"] = "haproxy" if os.environ.get(HAPROXY_ENV) == "1" else "serve-proxy"
    result["engine_loop"] = engine_loop(args.app_args)
    tag = "-engine-process" if result["engine_loop"] == "process" else ""
    tag += f"-replica-{result['app_args'].get('replica_transport', 'grpc')}"
    if result["http_path"] == "serve-proxy":
        result["proxy_transport"] = "grpc" if os.environ.get("RAY_SERVE_PROXY_USE_GRPC") == "1" else "actor"
        tag += f"-proxy-{result['proxy_transport']}"
    else:
        tag += "-haproxy"
    print("wrote", write_result(f"serve-overhead-{args.size}{tag}", result))


if __name__ == "__main__":
    main()
