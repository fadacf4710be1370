"""HTTP serving benchmark against the OpenAI API, printing what SGLang's and vLLM's bench_serving print.

    python -m bench.serve.load --url http://localhost:8000 --num-requests 200 --rate 8
    python -m bench.serve.load --launch --replicas 2 --router serve_default --size tiny ...

With --launch it starts a local Ray cluster and deploys the app itself (one or more variants in one
process: --replicas 1 2 --router adapter_affinity serve_default), so one device call compares them.

Claim mode (--arms, bench/serve/claim.py): the engine bench's claim measured through Serve, each arm a fresh
deployment at the same adapter memory, each workload a bench/workloads.py trace played open loop:

    python -m bench.serve.load --launch --arms A A0 serve_default --replicas 2 --capacity 8 --rate 28 \\
        --workload uniform@128 bursty-cv4@128 --num-requests 192 --length-scale 0.25 --batch 32 --max-ongoing 32

With --adapter-store s3 the adapters are read from an emulated S3 store (moto behind a proxy adding
--store-latency-ms per request and capping each connection at --store-mbps), each arm starting with an empty node
cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from bench.common import REPO_DEMO, RESULTS, write_result
from bench.serve.arms import SERVE_ARMS, RequestResult
from bench.serve.cluster import app_args_for, deploy, engine_loop, start_cluster, stream_completion
from bench.workloads import LENGTH_MODES, SEQUENTIAL_REQUESTS

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


async def run_load(url: str, models: list[str], args, rng: np.random.Generator) -> tuple[list[RequestResult], float]:
    chosen = pick_models(models, args.num_requests, args.workload[0], rng)
    gaps = rng.exponential(1.0 / args.rate, size=args.num_requests) if args.rate > 0 else np.zeros(args.num_requests)
    prompt = " ".join(["hello"] * args.prompt_words)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for model, gap in zip(chosen, gaps):
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(stream_completion(client, url, body, RequestResult(model, 0.0), start)))
            await asyncio.sleep(gap)
        results = await tqdm.gather(*tasks, desc="requests")
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], elapsed: float) -> dict:
    """Latencies from each request's send, as SGLang's and vLLM's bench_serving count them."""
    ok = [r for r in results if r.ok]
    ms = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else None  # noqa: E731
    ttft = [r.first_token_s - r.sent_s for r in ok if r.first_token_s is not None]
    e2e = [r.finished_s - r.sent_s for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
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
    from app.demo.build import ensure_demo
    from bench.adapter_pool import GPU_SIZE, prepare

    if args.size == GPU_SIZE:  # random 16 GB base built on the GPU and random rank-16 adapters
        base, adapter_dir, _ = prepare(args.size, args.adapters)
    else:
        demo = ensure_demo(REPO_DEMO / args.size, size=args.size)
        base, adapter_dir = demo / "base", demo / "adapters"
    start_cluster(args.port, not getattr(args, "serve_proxy", False))
    return deploy(args, app_args_for(args, base, adapter_dir, {"num_slots": args.slots, "router": router}), replicas)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true", help="start Ray and deploy the app here")
    parser.add_argument("--replicas", type=int, nargs="+", help="default: 1 (claim mode: 2)")
    parser.add_argument("--router", nargs="+", default=["adapter_affinity"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=32,
                        help="random adapters for llama3-8b-shape; claim mode: N of a workload given without @N")
    parser.add_argument("--app-args", default="{}", help='more AppArgs as JSON, e.g. \'{"engine_process": true}\'')
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-ongoing", type=int, help="max_ongoing_requests per replica (default 2 x --batch); "
                        "more requests wait in the router, where hints are sent")
    parser.add_argument("--gpus-per-replica", type=float, help="e.g. 0.5: two replicas share a GPU")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--serve-proxy", action="store_true", help="HTTP through Serve's proxy, not HAProxy")
    parser.add_argument("--workload", nargs="+", default=["uniform"],
                        help="one of uniform, zipf, base; claim mode: bench/workloads.py names, each name[@N]")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0, help="requests/s (Poisson); 0 sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    claim = parser.add_argument_group("claim mode (bench/serve/claim.py): each arm a fresh deployment")
    claim.add_argument("--arms", nargs="+", choices=list(SERVE_ARMS), help="A, A0 and/or serve_default, in order")
    claim.add_argument("--demo-dir", type=Path, help="a built demo to use instead of demo/<size> (tiny/small)")
    claim.add_argument("--capacity", type=int, default=8, help="M per replica in max-rank adapters")
    claim.add_argument("--host-cache-adapters", type=float,
                       help="host cache in max-rank adapters (default: every adapter; the disk variant: fewer)")
    claim.add_argument("--cold-disk", action="store_true", help="drop the adapter files from the OS page cache "
                       "before each run (and do not fill the host caches)")
    claim.add_argument("--warm-host", action=argparse.BooleanOptionalAction, default=True,
                       help="read every adapter into every replica's host cache before the first run")
    claim.add_argument("--adapter-store", default="local", choices=["local", "s3"],
                       help="s3: the adapters in an emulated S3 store (bench/serve/store.py), read through the app's "
                       "node cache, empty at each arm's start")
    claim.add_argument("--store-latency-ms", type=float, default=100.0, help="s3: first-byte delay of each request")
    claim.add_argument("--store-mbps", type=float, default=150.0, help="s3: bandwidth cap of each connection, MB/s")
    claim.add_argument("--store-shards", type=int, default=4, help="s3: moto processes, each holding every "
                       "distinct weights file")
    claim.add_argument("--store-cores", type=int, default=0, help="s3: host cores the store's processes run on "
                       "alone, the last of this process's; the cluster runs on the others (0: any core)")
    claim.add_argument("--store-proxies", type=int, default=2, help="s3: proxy processes on the store's one port")
    claim.add_argument("--store-distinct", type=int, help="s3: adapters generated, their bytes repeated over the N "
                       "names in the store (default: N)")
    claim.add_argument("--node-cache-adapters", type=float, help="s3: the node cache in adapters (default: all N)")
    claim.add_argument("--node-cache-root", help="s3: where each arm's node cache folder goes (default: $TMPDIR)")
    claim.add_argument("--lengths", default="slora", choices=LENGTH_MODES)
    claim.add_argument("--length-scale", type=float, default=1.0)
    claim.add_argument("--rotate-s", type=float, default=2.0, help="bursty: seconds between hot-set moves")
    claim.add_argument("--sequential-requests", type=int, default=SEQUENTIAL_REQUESTS)
    claim.add_argument("--time-budget-s", type=float, help="start no run that would end past this (seconds)")
    claim.add_argument("--drain-s", type=float, default=2.0, help="pause after each run")
    claim.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.replicas = args.replicas or [2 if args.arms else 1]
    if args.arms:
        if not args.launch or len(args.replicas) != 1 or args.rate <= 0:
            parser.error("--arms needs --launch, one --replicas value and --rate > 0")
        if args.adapter_store == "s3" and args.cold_disk:
            parser.error("--cold-disk drops local adapter files; with --adapter-store s3 every arm starts cold")
    elif args.adapter_store != "local":
        parser.error("--adapter-store s3 runs in claim mode (--arms)")
    elif len(args.workload) != 1 or args.workload[0] not in ("uniform", "zipf", "base"):
        parser.error("without --arms, --workload is one of uniform, zipf, base")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.arms:
        from bench.serve.claim import Claim

        paths = Claim(args).run()
        print("wrote", *map(str, paths), sep="\n  ") if paths else print("no run fits --time-budget-s")
        return paths
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
        # Where each replica's engine steps spent their time on the host, under this load (app/engine/step_timing.py).
        view = httpx.get(f"{url}/v1/debug/replicas", timeout=30).json()["replicas"]
        runs[name]["step_timing"] = {uid: r.get("step_timing") for uid, r in
                                     (view.items() if isinstance(view, dict) else enumerate(view))}
        print_table(name, runs[name])
    random.seed(args.seed)
    payload = {"workload": args.workload[0], "size": args.size, "num_requests": args.num_requests, "rate": args.rate,
               "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "seed": args.seed,
               "slots": args.slots, "batch": args.batch, "runs": runs}
    payload["app_args"] = json.loads(args.app_args)
    payload["engine_loop"] = engine_loop(args.app_args)
    print("wrote", write_result(f"serve-{args.workload[0]}-{args.size}{args.tag}", payload))


if __name__ == "__main__":
    main()
