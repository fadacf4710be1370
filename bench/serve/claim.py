"""The claim measured through Ray Serve (`python -m bench.serve.load --launch --arms A A0 serve_default ...`).

Each arm is a fresh deployment (a cold device pool) with the same replicas, adapter memory M per replica and
host cache; the arm sets only the router and whether it sends hints (bench/serve/arms.py). On each
deployment: an HTTP warm-up (base model and an adapter outside every trace), then unless --cold-disk every
adapter read once into every replica's host cache (called on each replica directly, not routed), then the
workloads in the order given, each a seeded trace of bench/workloads.py played open loop over HTTP: request i
is sent at its arrival time. Around each run the replicas' engine counters are read directly from each replica
(`engine_metrics`), so only the measured load counts. --cold-disk drops the adapter files from the OS page
cache before each run. --adapter-store s3 serves the adapters from an emulated S3 store (bench/serve/store.py)
instead: each arm gets an empty node cache of the same budget, and no host cache is filled beforehand.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict

import httpx
import ray
import torch
from ray import serve
from transformers import AutoTokenizer

from app.api.wire import ErrorReply, GenerateCall
from app.engine.config import EngineConfig
from app.demo.build import DEMO_VERSION
from app.sampling.params import SamplingParams
from bench.adapter_pool import adapter_name, prepare
from bench.common import write_result
from bench.engine.arms import drop_page_cache
from bench.engine.driver import metrics_delta, vocab_ids
from bench.engine.hints import max_rank_adapter_bytes
from bench.serve.arms import (NOTES, REMOTE_NOTES, SERVE_ARMS, RequestResult, remote_delta, remote_line,
                              request_bodies, step_totals_delta, sum_deltas, summarize)
from bench.serve.cluster import APP_NAME, app_args_for, deploy, start_cluster, stream_completion
from bench.serve.host_cpu import CpuWindow
from bench.workloads import SEQUENTIAL_ADAPTERS, WORKLOADS, make
from deploy.state import find_router_state

POLL_S = 0.5  # the router-wait sampler: the replicas report to the view about this often
SETTLE_S = 30.0  # longest wait for the replicas to go idle after a run
MAX_RANK = 16  # the replicas' max_rank (AppArgs' default), the rank of a --capacity unit


def parse_workloads(items: list[str], args) -> list[tuple[str, int, int]]:
    """(workload, N, requests) from names with an optional @N (default: --adapters; sequential 50)."""
    runs = []
    for item in items:
        name, _, n = item.partition("@")
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
        default_n = SEQUENTIAL_ADAPTERS if name == "sequential" else args.adapters
        runs.append((name, int(n) if n else default_n,
                     args.sequential_requests if name == "sequential" else args.num_requests))
    return runs


# --- the replicas, called directly (not routed) ---------------------------------------------------------

def replica_actors() -> dict[str, ray.actor.ActorHandle]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#LoRAReplica#"
    return {a["name"][len(prefix):]: ray.get_actor(a["name"], namespace="serve")
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def call_replica(actor, method: str, *args, stream: bool = False):
    """A method of the replica's deployment class on that replica, as Serve's actor transport calls it: an
    ObjectRef, or with stream (a generator method) an ObjectRefGenerator of its items."""
    from ray.serve._private.common import RequestMetadata

    request_id = uuid.uuid4().hex
    metadata = pickle.dumps(RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method=method,
                                            app_name=APP_NAME, is_streaming=stream))
    if stream:
        return actor.handle_request_streaming.options(num_returns="streaming").remote(metadata, *args)
    return actor.handle_request.remote(metadata, *args)


def engine_snapshots(actors: dict) -> dict[str, dict]:
    uids = list(actors)
    return dict(zip(uids, ray.get([call_replica(actors[u], "engine_metrics") for u in uids], timeout=60)))


def hints_pushed() -> int:
    """Hints the router actor has passed on since the deployment started, of both kinds (waiting, incoming)."""
    try:
        actor = find_router_state(APP_NAME, None)
    except ValueError:
        return 0
    stats = ray.get(actor.stats.remote(), timeout=30)
    return sum(stats["hints_pushed"].values())


def warm_host(actors: dict, names: list[str]) -> None:
    """Every adapter through every replica once (one token), so each replica's host cache holds them all."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    streams = [call_replica(actor, "stream", GenerateCall(prompts=[[8, 9, 10, 11]], params=params, adapter_id=name,
                                                          request_id=f"warm-host-{uid}-{i}"), stream=True)
               for uid, actor in actors.items() for i, name in enumerate(names)]
    items = [ray.get(ref, timeout=600) for refs in streams for ref in refs]
    errors = [item.body["error"] for item in items if isinstance(item, ErrorReply)]
    if errors:
        raise RuntimeError(f"{len(errors)} host warm-up requests failed, first: {errors[0]}")


def wait_idle(actors: dict) -> dict[str, dict]:
    """The replicas' snapshots once none has a request running or queued (cancelled streams end late)."""
    deadline = time.time() + SETTLE_S
    while True:
        snapshots = engine_snapshots(actors)
        if time.time() > deadline or all(s["batch_size"] == 0 and s["queue_length"] == 0 for s in snapshots.values()):
            return snapshots
        time.sleep(0.2)


# --- one run ---------------------------------------------------------------------------------------------

async def play(url: str, arrivals, bodies: list[dict]) -> tuple[list[RequestResult], list[tuple[int, int]]]:
    """Send request i at arrival i's time (open loop); sample the requests waiting in the router meanwhile."""
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    samples: list[tuple[int, int]] = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []

        async def sample():
            while True:
                await asyncio.sleep(POLL_S)
                inflight = sum(not t.done() for t in tasks)
                try:
                    view = (await client.get(f"{url}/v1/debug/replicas", timeout=5)).json()["replicas"]
                except (httpx.HTTPError, ValueError, KeyError):
                    continue
                samples.append((inflight, sum(r.get("running", 0) + r.get("waiting", 0) for r in view.values())))

        sampler = asyncio.create_task(sample())
        for a, body in zip(arrivals, bodies):
            delay = start + a.t_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result = RequestResult(body["model"], a.t_s)
            tasks.append(asyncio.create_task(stream_completion(client, url, body, result, start)))
        results = await asyncio.gather(*tasks)
        sampler.cancel()
    return results, samples


def run_one(args, url: str, actors: dict, workload: str, n: int, count: int, names: list[str], adapter_dir,
            model_id: str, vocab, store_pids: Sequence[int] = ()) -> tuple[dict, dict]:
    """One workload's trace on a deployed arm: (its summary, the replicas' engine snapshots before it).
    store_pids: the emulated store's processes, whose CPU time the summary's host_cpu counts apart."""
    arrivals = make(workload, n, count, args.rate, args.seed, args.lengths, args.length_scale, args.capacity,
                    args.rotate_s)
    bodies = request_bodies(arrivals, names, model_id, vocab, args.seed)
    if args.cold_disk:
        drop_page_cache(adapter_dir, names[:n])  # local adapters only (load.py refuses it with s3)
    before, pushed = wait_idle(actors), hints_pushed()
    cpu = CpuWindow(store_pids)
    results, samples = asyncio.run(play(url, arrivals, bodies))
    host_cpu = cpu.read()
    after = wait_idle(actors)
    deltas = {uid: metrics_delta(before[uid], after[uid]) for uid in before if uid in after}
    if args.adapter_store != "local":
        for uid, d in deltas.items():
            d["remote"] = remote_delta(before[uid], after[uid])
    per_replica = {uid: {"arrival_kinds": {k: d[k] for k in ("hint_hits", "inflight_hits", "misses")},
                         "hints_received": d["hints_received"], "stall_s": d["stall_seconds"]["sum"],
                         "loads": d["loads_started"], "evictions": d["evictions"], "remote": d.get("remote"),
                         # the host's and the GPU's share of the run's last steps (app/engine/step_timing.py)
                         "step_timing": after[uid].get("step_timing"),
                         "step_totals": step_totals_delta(before[uid], after[uid])}
                   for uid, d in deltas.items()}
    total = sum_deltas(list(deltas.values()))
    if "remote" in total:  # what a cold node cache must fetch at least, for the extra downloads beyond it
        total["remote"]["adapters_requested"] = len({a.adapter for a in arrivals if a.adapter is not None})
    summary = summarize(results, total, per_replica, hints_pushed() - pushed, samples)
    return {**summary, "host_cpu": host_cpu}, before


# --- the arms --------------------------------------------------------------------------------------------

def pool_info(snapshots: dict, unit: int) -> dict:
    """Each replica's device pool and host arena as its engine reports them; M in bytes from the pages."""
    return {uid: {"pages": s["pages_total"], "slots": s["slots_total"], "page_rows": s["page_rows"],
                  "adapter_memory_bytes": s["pages_total"] * unit // math.ceil(MAX_RANK / s["page_rows"]),
                  "host_arena_bytes": s["host_arena_bytes"], "host_pinned_bytes": s["host_pinned_bytes"],
                  "host_cache_bytes_at_start": s["host_cache_bytes"]} for uid, s in snapshots.items()}


# A later arm's deployment over the first's: the base is in the page cache by then (82-89 s against 127-133 s in
# bench/results/h100-x1-serve-remote-uniform-rate5-store-cores6*.json); 0.8 leaves a margin.
LATER_DEPLOY = 0.8


class Claim:
    """The arms in order, each on a fresh deployment, the workloads of the first arm that fit --time-budget-s."""

    def __init__(self, args):
        self.args, self.started = args, time.perf_counter()
        self.runs = parse_workloads(args.workload, args)
        count = max(n for _, n, _ in self.runs) + 1  # the last adapter is the warm-up's, in no trace
        distinct = min(args.store_distinct or count, count) if args.adapter_store == "s3" else count
        self.base, self.adapter_dir, self.names = prepare(args.size, distinct, args.seed, args.demo_dir)
        self.remote, self.adapter_root = None, self.adapter_dir
        if args.adapter_store == "s3":  # before Ray starts: its workers inherit the store's environment
            from bench.serve.remote_adapters import RemoteAdapters
            from bench.serve.store import StoreConfig

            if ray.is_initialized():
                raise SystemExit("--adapter-store s3 sets the store's endpoint in the environment Ray's workers "
                                 "inherit; start it with no Ray running in this process")

            folders = [self.adapter_dir / self.names[i % distinct] for i in range(count)]
            self.names = [adapter_name(i) for i in range(count)]
            self.remote = RemoteAdapters(StoreConfig(args.store_latency_ms, args.store_mbps, args.store_shards,
                                                     args.store_proxies, args.store_cores), folders, self.names,
                                         args.node_cache_adapters, args.node_cache_root)
            self.adapter_root = self.remote.root
            print(f"adapter store: {self.remote.upload}\n  floor: {self.remote.floor}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the base was built on the GPU here: leave its memory to the replicas
        config = EngineConfig(base_model=str(self.base), adapter_roots=(str(self.adapter_dir),),
                              max_rank=MAX_RANK)
        self.unit = max_rank_adapter_bytes(config)  # bytes of one max-rank adapter: the unit of --capacity
        self.memory = {"adapter_memory_bytes": args.capacity * self.unit,
                       "host_cache_bytes": int((args.host_cache_adapters or count) * self.unit)}
        self.vocab = vocab_ids(AutoTokenizer.from_pretrained(str(self.base)))
        self.warm_host = args.warm_host and not args.cold_disk and self.remote is None
        self.results = {w: {} for w, _, _ in self.runs}
        self.pools = {w: {} for w, _, _ in self.runs}
        self.chosen, self.measured, self.skipped, self.deploy_s, self.app = [], {}, [], {}, None
        start_cluster(args.port, not args.serve_proxy)
        self.timings = {"prepare": time.perf_counter() - self.started}

    def run(self) -> list:
        try:
            for i, arm in enumerate(self.args.arms):
                self.run_arm(i, arm)
        finally:
            if self.remote is not None:
                self.remote.close()
        self.timings["total"] = time.perf_counter() - self.started
        return [self.write(w, n, r) for w, n, r in self.runs if self.results[w]]

    def run_arm(self, i: int, arm_name: str) -> None:
        args, t0 = self.args, time.perf_counter()
        if i > 0 and not self.chosen or not self.can_deploy(i):
            self.skipped += [{"workload": w, "arm": arm_name} for w, _, _ in self.chosen]
            return
        node_cache = self.remote.fresh_cache() if self.remote else {}  # every arm starts cold
        self.app = app_args_for(args, self.base, self.adapter_root,
                                {**self.memory, **node_cache, **SERVE_ARMS[arm_name].app_args()})
        url = deploy(args, self.app, args.replicas[0])
        actors = replica_actors()
        warm_up(url, self.app.served_model_id, self.names[-1], len(actors))
        if self.warm_host:
            warm_host(actors, self.names[:-1])
        self.deploy_s[arm_name] = time.perf_counter() - t0
        print(f"{arm_name}: deployed and warmed in {self.deploy_s[arm_name]:.0f} s, "
              f"{time.perf_counter() - self.started:.0f} s in", flush=True)
        for workload, n, requests in (self.runs if i == 0 else list(self.chosen)):
            if not self.fits(i, arm_name, workload, requests):
                self.skipped.append({"workload": workload, "arm": arm_name})
                continue
            t1 = time.perf_counter()
            summary, before = run_one(args, url, actors, workload, n, requests, self.names, self.adapter_dir,
                                      self.app.served_model_id, self.vocab,
                                      self.remote.store.pids() if self.remote else ())
            self.results[workload][arm_name] = summary
            self.pools[workload][arm_name] = pool_info(before, self.unit)
            if i == 0:
                self.chosen.append((workload, n, requests))
                self.measured[workload] = time.perf_counter() - t1 + args.drain_s
            print_run(arm_name, workload, n, summary)
            self.timings["elapsed"] = time.perf_counter() - self.started
            self.write(workload, n, requests)  # after every run: a run killed from outside keeps what it measured
            time.sleep(args.drain_s)
        serve.delete(APP_NAME)
        if self.remote is not None:
            self.remote.drop_cache()

    def can_deploy(self, i: int) -> bool:
        """A later arm deploys only if its first run can end within the budget, deploying as the arm before it did
        (the first arm's deployment reads the base from a cold page cache, and takes the longest)."""
        if i == 0 or not self.args.time_budget_s:
            return True
        first_workload = self.chosen[0][0]
        needed = self.deploy_s[self.args.arms[i - 1]] + self.measured[first_workload]
        return time.perf_counter() - self.started + needed <= self.args.time_budget_s

    def fits(self, i: int, arm_name: str, workload: str, requests: int) -> bool:
        """Whether this run, and (first arm) the same workload on the second arm, end within the budget: the first
        two arms are the pair compared; a third runs where time is left (can_deploy)."""
        if not self.args.time_budget_s:
            return True
        estimate = self.measured.get(workload) or requests / self.args.rate * 1.5 + 15
        later = 0.0
        if i == 0:  # the second arm redeploys and plays every workload the first arm played
            per_arm = (LATER_DEPLOY * self.deploy_s[arm_name] + 10 + estimate
                       + sum(self.measured[w] for w, _, _ in self.chosen))
            later = (min(len(self.args.arms), 2) - 1) * per_arm
        elapsed = time.perf_counter() - self.started
        if elapsed + estimate + later <= self.args.time_budget_s:
            return True
        print(f"{arm_name} {workload}: {elapsed:.0f} s in, the run ~{estimate:.0f} s and a later arm's ~{later:.0f} s "
              f"would pass --time-budget-s {self.args.time_budget_s:.0f}", flush=True)
        return False

    def write(self, workload: str, n: int, requests: int):
        args, app = self.args, self.app
        variant = "remote" if self.remote else "disk" if args.host_cache_adapters is not None else "warm-host"
        notes = NOTES + (REMOTE_NOTES if self.remote else [])
        if len(self.runs) > 1:
            notes.append("The workloads of an arm run one after another on one deployment: a later workload "
                         "starts with the device pool and host cache the previous one left.")
        skipped = [s for s in self.skipped if s["workload"] == workload]
        name = f"serve-{'remote' if self.remote else 'claim'}-{workload}" + ("-disk" if variant == "disk" else "")
        return write_result(name + args.tag, {
            "benchmark": "serve-claim", "complete": "total" in self.timings and not skipped, "skipped_runs": skipped,
            "workload": workload, "workload_spec": asdict(WORKLOADS[workload]), "n": n, "requests_per_run": requests,
            "rate": args.rate, "size": args.size, "demo_version": DEMO_VERSION, "replicas": args.replicas[0],
            "gpus_per_replica": args.gpus_per_replica, "variant": variant, "cold_disk": args.cold_disk,
            "host_cache_warmed": self.warm_host, "capacity": args.capacity, "max_rank_adapter_bytes": self.unit,
            "adapter_memory_bytes_asked": app.adapter_memory_bytes, "host_cache_bytes": app.host_cache_bytes,
            "host_cache_adapters": args.host_cache_adapters, "pool": self.pools[workload],
            "max_ongoing_requests": app.max_ongoing_requests or 2 * app.max_batch_size,
            "max_batch_size": app.max_batch_size, "compile_decode": app.compile_decode,
            "app_args": app.model_dump(exclude={"router", "hints", "api_key", "adapters"}),
            "arms": {a: SERVE_ARMS[a].config() for a in args.arms}, "lengths": args.lengths,
            "length_scale": args.length_scale, "rotate_s": args.rotate_s, "bursty_hot_set": args.capacity,
            "seed": args.seed, "deploy_and_warm_s": self.deploy_s, "timings_s": self.timings, "notes": notes,
            "adapter_store": self.remote.record() if self.remote else None,
            "results": self.results[workload],
        }, args.results_dir)


def warm_up(url: str, model_id: str, adapter: str, replicas: int) -> None:
    """First-call costs of the serving path on every replica, with the base model and an adapter in no trace."""
    async def go():
        bodies = [{"model": m, "prompt": [8, 9, 10, 11] * 4, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                   "stream": True} for m in (model_id, adapter) for _ in range(2 * replicas)]
        async with httpx.AsyncClient(timeout=600) as client:
            start = time.perf_counter()
            await asyncio.gather(*(stream_completion(client, url, b, RequestResult(b["model"], 0.0), start)
                                   for b in bodies))
    asyncio.run(go())


def print_run(arm: str, workload: str, n: int, s: dict) -> None:
    ms = lambda x: "n/a" if x is None else f"{1e3 * x:.0f}"  # noqa: E731
    rate = "n/a" if s["hint_hit_rate"] is None else f"{s['hint_hit_rate']:.2f}"
    wait = s["router_wait"]["mean"]
    print(f"{workload} N={n} {arm}: {s['completed']}/{s['requests']} ok, TTFT p50/p99 {ms(s['ttft_s']['p50'])}/"
          f"{ms(s['ttft_s']['p99'])} ms, {s['request_throughput_per_s']:.2f} req/s, hit rate {rate}, stall "
          f"{1e3 * s['stall_s_per_request']:.1f} ms/req, waiting in router {'n/a' if wait is None else f'{wait:.1f}'}"
          f" (mean), hints to replicas {s['hints_received']}, E2E p50/p99 {ms(s['e2e_s']['p50'])}/"
          f"{ms(s['e2e_s']['p99'])} ms{remote_line(s)}{cpu_line(s.get('host_cpu'))}", flush=True)


def cpu_line(cpu: dict | None) -> str:
    if cpu is None:
        return ""
    store = f", the store's processes {cpu['processes_cpu_s']:.0f} CPU s" if cpu["processes"] else ""
    return f"; host {cpu['busy_cores_mean']:.1f} of {cpu['cores']} cores busy{store}"
