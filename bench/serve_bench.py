"""HTTP serving benchmark against the OpenAI API, printing what SGLang's and vLLM's bench_serving print.

    python -m bench.serve_bench --url http://localhost:8000 --num-requests 200 --rate 8
    python -m bench.serve_bench --launch --replicas 2 --router serve_default --size tiny ...

With --launch it starts a local Ray cluster and deploys the app itself (one or more variants in one
process: --replicas 1 2 --router adapter_affinity serve_default), so one device call compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from bench.common import REPO_DEMO, write_result


@dataclass
class Result:
    model: str
    ok: bool = False
    status: int = 0
    ttft: float = 0.0
    itls: list = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    replica: str | None = None


def pick_models(models: list[str], n: int, workload: str, rng: np.random.Generator) -> list[str]:
    adapters = models[1:]
    if workload == "uniform":
        return [adapters[i] for i in rng.integers(len(adapters), size=n)]
    if workload == "zipf":  # P(k) ∝ k^-1.5 over the adapters
        weights = 1.0 / np.arange(1, len(adapters) + 1) ** 1.5
        return [adapters[i] for i in rng.choice(len(adapters), size=n, p=weights / weights.sum())]
    if workload == "base":
        return [models[0]] * n
    raise ValueError(workload)


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Result:
    result = Result(model)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-replica-id")
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return result
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                    continue
                if not chunk["choices"][0]["text"]:
                    continue
                if not result.ttft:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)  # per chunk; a chunk may carry several tokens
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError:
        pass
    return result


async def run_load(url: str, models: list[str], args, rng: np.random.Generator) -> tuple[list[Result], float]:
    chosen = pick_models(models, args.num_requests, args.workload, rng)
    gaps = rng.exponential(1.0 / args.rate, size=args.num_requests) if args.rate > 0 else np.zeros(args.num_requests)
    prompt = " ".join(["hello"] * args.prompt_words)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for model, gap in zip(chosen, gaps):
            tasks.append(asyncio.create_task(one(client, url, model, prompt, args.max_tokens)))
            await asyncio.sleep(gap)
        results = await tqdm.gather(*tasks, desc="requests")
    return results, time.perf_counter() - start


def summarize(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else None  # noqa: E731
    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    itl = [x for r in ok for x in r.itls]
    tokens = sum(r.tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "statuses": {str(s): sum(r.status == s for r in results) for s in {r.status for r in results}},
        "duration_s": elapsed, "request_throughput": len(ok) / elapsed, "output_token_throughput": tokens / elapsed,
        "ttft_ms": {"mean": 1e3 * statistics.fmean(ttft) if ttft else None, "p50": ms(ttft, 50), "p99": ms(ttft, 99)},
        "itl_ms": {"mean": 1e3 * statistics.fmean(itl) if itl else None, "p50": ms(itl, 50), "p99": ms(itl, 99)},
        "e2e_ms": {"mean": 1e3 * statistics.fmean(e2e) if e2e else None, "p50": ms(e2e, 50), "p99": ms(e2e, 99)},
        "replicas_used": len({r.replica for r in ok}),
    }


def print_table(name: str, s: dict) -> None:
    print(f"{'=' * 16} Serving Benchmark Result: {name} {'=' * 16}")
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_token_throughput']:.2f}")]
    for metric in ("ttft", "itl", "e2e"):
        for stat in ("mean", "p50", "p99"):
            value = s[f"{metric}_ms"][stat]
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)", "n/a" if value is None else f"{value:.2f}"))
    for label, value in rows:
        print(f"{label:<40}{value:>14}")


def launch(args, replicas: int, router: str) -> str:
    import ray
    from ray import serve

    from app.demo import ensure_demo
    from bench.adapter_pool import GPU_SIZE, prepare
    from deploy.app import make_app
    from deploy.args import AppArgs

    if args.size == GPU_SIZE:  # random 16 GB base built on the GPU and random rank-16 adapters
        base, adapter_dir, _ = prepare(args.size, args.adapters)
    else:
        demo = ensure_demo(REPO_DEMO / args.size, size=args.size)
        base, adapter_dir = demo / "base", demo / "adapters"
    if not ray.is_initialized():
        ray.init()
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app_args = AppArgs(base_model=str(base), adapter_roots=[str(adapter_dir)], build_demo=False,
                       num_slots=args.slots, max_batch_size=args.batch, router=router, max_input_tokens=1024,
                       max_total_tokens=args.batch * 2048, **json.loads(args.app_args))
    serve.run(make_app(app_args, num_replicas=replicas), name="lora", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if len(httpx.get(f"{url}/v1/debug/replicas", timeout=5).json()["replicas"]) >= replicas:
                return url
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError("replicas did not come up")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start Ray and deploy the app here")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1])
    parser.add_argument("--router", nargs="+", default=["adapter_affinity"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=32, help="random adapters for llama3-8b-shape")
    parser.add_argument("--app-args", default="{}", help='more AppArgs as JSON, e.g. \'{"engine_process": true}\'')
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workload", default="uniform", choices=["uniform", "zipf", "base"])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0, help="requests/s (Poisson); 0 sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs = {}
    variants = [(r, router) for router in args.router for r in args.replicas] if args.launch else [(None, None)]
    for replicas, router in variants:
        url = launch(args, replicas, router) if args.launch else args.url
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        warm = asyncio.run(run_load(url, models, argparse.Namespace(**{**vars(args), "num_requests": 16, "rate": 0}),
                                    np.random.default_rng(args.seed + 1)))
        del warm
        results, elapsed = asyncio.run(run_load(url, models, args, np.random.default_rng(args.seed)))
        name = f"{replicas}rep-{router}" if args.launch else "external"
        runs[name] = summarize(results, elapsed)
        # Where each replica's engine steps spent their time on the host, under this load (app/step_timing.py).
        view = httpx.get(f"{url}/v1/debug/replicas", timeout=30).json()["replicas"]
        runs[name]["step_timing"] = {uid: r.get("step_timing") for uid, r in
                                     (view.items() if isinstance(view, dict) else enumerate(view))}
        print_table(name, runs[name])
    random.seed(args.seed)
    payload = {"workload": args.workload, "size": args.size, "num_requests": args.num_requests, "rate": args.rate,
               "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "seed": args.seed,
               "slots": args.slots, "batch": args.batch, "runs": runs}
    payload["app_args"] = json.loads(args.app_args)
    print("wrote", write_result(f"serve-{args.workload}-{args.size}{args.tag}", payload))


if __name__ == "__main__":
    main()
