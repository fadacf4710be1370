"""The app as the serve benchmarks launch and drive it: a local Ray cluster, a deployment of given AppArgs,
and one streaming completion timed chunk by chunk. Shared by bench/serve/load.py and bench/serve/claim.py."""

from __future__ import annotations

import json
import os
import time

import httpx

from bench.serve.arms import RequestResult

APP_NAME = "lora"


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult,
                            start: float) -> RequestResult:
    """POST one streaming completion; fill `result` with its status, replica and times (seconds after `start`)."""
    clock = lambda: time.perf_counter() - start  # noqa: E731
    result.sent_s, result.chunk_s = clock(), []
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
                now = clock()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return result
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"][0]["text"]:
                    result.chunk_s.append(now)  # a chunk may carry several tokens
        result.first_token_s = result.chunk_s[0] if result.chunk_s else None
        result.finished_s = clock()
        result.ok = True
    except httpx.HTTPError:
        pass
    return result


def start_cluster(port: int, haproxy: bool = True) -> None:
    """A local cluster on HTTP `port`, behind HAProxy as `make serve` runs it where HAProxy can run (haproxy=False:
    Serve's proxy)."""
    import ray
    from ray import serve

    from deploy.haproxy import HAPROXY_ENV, environment

    if not ray.is_initialized():  # read by the controller that ray.init starts
        os.environ.update(environment() if haproxy else {HAPROXY_ENV: "0"})
        ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": port})  # connects to Serve if it is running


def app_args_for(args, base, adapter_dir, fields: dict):
    """AppArgs for a launched deployment: the bench's defaults, then `fields`, then --app-args, which win
    (num_slots there drops the adapter_memory_bytes given here, and the other way round). bench/serve/overhead.py
    passes args of its own, without max_ongoing."""
    from deploy.args import AppArgs

    extra = json.loads(args.app_args)
    merged = {"base_model": str(base), "adapter_roots": [str(adapter_dir)], "build_demo": False,
              "max_batch_size": args.batch, "max_input_tokens": 1024, "max_total_tokens": args.batch * 2048,
              "max_ongoing_requests": getattr(args, "max_ongoing", None), **fields}
    for given, dropped in (("num_slots", "adapter_memory_bytes"), ("adapter_memory_bytes", "num_slots")):
        if given in extra:
            merged.pop(dropped, None)
    return AppArgs(**{**merged, **extra})


def engine_loop(app_args_json: str) -> str:
    """Where the launched replicas run their engine loop: "process" or "thread" (the app's rule, AppArgs.
    engine_in_process; the bench launches on this machine)."""
    from deploy.args import AppArgs

    return "process" if AppArgs(build_demo=False, **json.loads(app_args_json)).engine_in_process() else "thread"


def replica_overrides(args, app_args, replicas: int) -> dict:
    """make_app's overrides of the replica options: the count, and --gpus-per-replica (num_cpus kept)."""
    from deploy.app import replica_options

    overrides = {"num_replicas": replicas}
    gpus = getattr(args, "gpus_per_replica", None)  # bench/serve/overhead.py's args have no such field
    if gpus is not None:  # e.g. 0.5: two replicas share one GPU (set kv_cache_bytes then)
        actor_options = replica_options(app_args)["ray_actor_options"]
        overrides["ray_actor_options"] = {**actor_options, "num_gpus": gpus}
    return overrides


def deploy(args, app_args, replicas: int) -> str:
    """Deploy (or redeploy) the app; return its URL once every replica reports."""
    from ray import serve

    from deploy.app import make_app

    serve.run(make_app(app_args, **replica_overrides(args, app_args, replicas)), name=APP_NAME, route_prefix="/")
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
