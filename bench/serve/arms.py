"""The claim through Ray Serve: the arms, a trace as HTTP request bodies, and what the
replicas' engines counted over one run. Pure Python and numpy: no Ray, no HTTP (bench/serve/claim.py runs it).

Arms, each a fresh deployment with the same replicas, adapter memory M and host cache:
  A              the adapter-affinity router, sending hints for requests that wait in it
  A0             the same router and placement, no hints (AppArgs.hints = False)
  serve_default  Serve's own router (power of two choices); it sends no hints
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from bench.engine.driver import COUNTERS, HISTOGRAMS
from bench.stats import hit_rate, percentiles
from bench.workloads import Arrival, random_prompt


@dataclass(frozen=True)
class ServeArm:
    name: str
    label: str
    router: str  # AppArgs.router
    hints: bool  # AppArgs.hints: whether the router sends hints (serve_default sends none either way)

    def app_args(self) -> dict:
        return {"router": self.router, "hints": self.hints}

    def config(self) -> dict:
        return {"label": self.label, **self.app_args()}


SERVE_ARMS = {a.name: a for a in (
    ServeArm("A", "adapter affinity + hints", "adapter_affinity", hints=True),
    ServeArm("A0", "adapter affinity, no hints", "adapter_affinity", hints=False),
    ServeArm("serve_default", "Serve's default router", "serve_default", hints=False),
)}

NOTES = [
    "Engine counters are differences of each replica's engine metrics right before and right after the "
    "measured load (the warm-up does not count), summed over replicas.",
    "hint_hit_rate: (hint_hits + inflight_hits) / arrivals, over every arrival at a replica, as the engine "
    "bench defines it (resident or already loading).",
    "hint_hit_rate_when_queued: the same rate over the arrivals of requests that waited in the router and were "
    "hinted to the replica they reached (each consumes a waiting hint there; hinted_arrivals splits them by "
    "where their adapter was: a slot, the host cache or a read into it, or nowhere). Requests that waited but "
    "were held back by the hint budget are not among them (lora_router_placements{outcome=hint_deferred}, "
    "Prometheus only). router_wait estimates the requests waiting in the router: client in-flight minus the "
    "replicas' running + waiting, from a view up to 0.5 s old (so it reads about 1 high at light load).",
    "hints_received (the engines') counts waiting-kind hints: one per request and replica it waited for in the "
    "router (a request whose target changes is hinted at the new replica and withdrawn at the old one). "
    "hints_pushed (the router actor's) also counts the incoming-kind hints to the replica a request may spread to, "
    "not the withdrawals. hints_late counts hints that reached an engine after their own request (matched by "
    "Serve's request id) and were dropped. hints_duplicate counts hints an engine ignored because it held one for "
    "that request already (a request hinted again after a full replica turned it away).",
    "wasted_prefetch_bytes counts bytes loaded and evicted unused; adapters loaded and still unused at the end "
    "cannot be seen from outside the replica (unused_resident_bytes_at_end is null).",
    "itl_s: gaps between streamed chunks that carry text; a chunk may carry several tokens, and a token that "
    "decodes to no text sends no chunk (as in vLLM). With demo_version 1 the llama3-8b-shape demo decoded almost "
    "every sampled id to no text (a 1,024-token tokenizer over 128,256 ids), so itl_s measured the gaps between "
    "rare text-bearing tokens; from demo_version 2 every id decodes to text and itl_s is the token cadence.",
    "adapter_wait_s_mean: from a request's arrival at its replica to its adapter's slot being ready for it, over "
    "requests with an adapter; adapter_wait_before_load_s_mean: the part of it before its adapter's load into a slot "
    "began (waiting for a slot to free; a read into the host cache may run meanwhile). The rest is the load: the "
    "disk read, if the host cache did not hold the adapter, and the copy.",
    "replica_first_token_s_mean and replica_request_s_mean: from a request's arrival at its "
    "replica's engine to its first token and to its end, over the requests that ended in the run; with "
    "adapter_wait_s_mean they split a request's time at its replica (the rest of its E2E is the router and HTTP).",
    "The router's placement outcomes (affinity / spread / cold / ...) go to Prometheus only "
    "(lora_router_placements) and are not recorded here.",
    "host_cpu: the host over the trace's playing, from /proc: busy_cores_mean of its cores, and processes_cpu_s, "
    "the CPU seconds of the emulated store's processes (none with local adapters), which a real store would not "
    "put on the serving node.",
    "per_replica.step_totals: each replica's engine steps over the whole run, decode-only and mixed: how many, "
    "their seconds (admission, host and GPU), the host's part, the rows sampled (tokens made), and the mean step "
    "and rows per step; between: the engine thread's time from one step's end to the next one's start while "
    "requests were in the engine (delivering outputs, taking commands such as hints), not in any step, with the "
    "thread's CPU seconds in it; host_cpu_seconds: the engine thread's CPU time over a kind's host parts (less "
    "than host_seconds by the time it waited to run again); gc: the engine process's garbage collections per "
    "generation and their seconds; work: the engine thread's time outside steps by what it did (each command by "
    "name: hint, add, routing_stats, metrics, ...; deliver), wall and CPU seconds (wall well above CPU: the "
    "thread waited, for the GIL or a file system call).",
    "per_replica.step_timing: each replica's engine steps over the run's last 512 of each kind, split into the "
    "host's time before and after the GPU's (app/engine/step_timing.py): work that competes with the engine for "
    "the host (fetches, reads) shows there. With sample_stalls_ms in the app's args, its stalls say, since the "
    "replica started, where the engine thread was while a host part of its loop ran past that many ms, and which "
    "other threads of its process were busy then, and wake_late_ms how late the sampler woke: its wait for the "
    "GIL (app/engine/stall_sampler.py).",
]

REMOTE_NOTES = [
    "adapter_store: the adapters lay in moto's S3 server, `shards` processes of it (each holding every distinct "
    "weights file, which the adapters' weights keys alias; configs in the first), behind `proxies` proxy processes "
    "that spread one object's ranges over the shards, delay each request's first response byte by latency_ms and "
    "cap each connection at mbps (bench/serve/store.py); floor holds what a client measured through it in the "
    "same run (ttfb_ms_p50 of a 1 KiB ranged GET, single_connection_mb_per_s of one GET of a whole adapter, "
    "parallel_mb_per_s of `connections` ranged GETs at once over parallel_objects "
    "adapters, app_download_s of one adapter fetched as a replica fetches it). Each arm started with an empty "
    "node cache of node_cache_bytes, and no host cache was filled before the runs.",
    "remote: the node cache's counters over the run, summed over the replicas (each counts what its own process "
    "did in the cache they share, so the sum is the node's): fetched_bytes and downloads from the store, "
    "cache_hits, waited_for_other (another replica was fetching it). adapters_requested: the distinct adapters of "
    "the run's trace, each of which a cold node cache must fetch once; extra_downloads: downloads beyond them "
    "(fetched again after an eviction, or never requested). fetched_ahead: fetches started by hints or "
    "queued requests before any read needed them; wasted_fetches: those that no read of the same replica used "
    "during the run (fetched_ahead - fetched_ahead_used, and the bytes); with several replicas, an adapter "
    "fetched ahead by one and read by another from the cache they share counts here for the first. "
    "wasted_remote_bytes: what the node downloaded beyond the adapters the trace requested (extra_downloads "
    "at the mean download's size; the bench's adapters are all one size), the bytes no request on the node "
    "needed; wasted_remote_share: their share of fetched_bytes.",
    "hinted_on_node_share: of the arrivals that waited in the router and were hinted to their replica, the share "
    "whose adapter was on the node or closer when they arrived (device, host or node disk) rather than still in "
    "the store; hint_hit_rate_when_queued counts the store tier in its denominator.",
]

NODE_CACHE_COUNTERS = ("downloads", "downloaded_bytes", "download_seconds", "hits", "waited_for_other", "evictions",
                       "evicted_bytes", "fetched_ahead", "fetched_ahead_bytes", "fetched_ahead_used",
                       "fetched_ahead_used_bytes")


def request_bodies(arrivals: list[Arrival], adapter_names: list[str], base_model_id: str, vocab: np.ndarray,
                   seed: int) -> list[dict]:
    """One streaming /v1/completions body per arrival: a token-id prompt of its length, max_tokens = its output
    length with EOS ignored. The same seed gives the same prompts for every arm, as in the engine bench."""
    rng = np.random.default_rng(seed)
    return [{"model": base_model_id if a.adapter is None else adapter_names[a.adapter],
             "prompt": random_prompt(a.prompt_len, vocab, rng), "max_tokens": a.output_len, "temperature": 0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for a in arrivals]


def _histogram_sum(histograms: list[dict]) -> dict:
    buckets = Counter()
    for h in histograms:
        buckets.update(h["buckets"])
    return {"count": sum(h["count"] for h in histograms), "sum": sum(h["sum"] for h in histograms),
            "buckets": dict(buckets)}


def remote_delta(before: dict, after: dict) -> dict:
    """One replica's hinted_from_store and node cache counters between two engine snapshots (zeros without a
    node cache: local adapters)."""
    cache_before, cache_after = before.get("node_cache", {}), after.get("node_cache", {})
    out = {k: cache_after.get(k, 0) - cache_before.get(k, 0) for k in NODE_CACHE_COUNTERS}
    out["hinted_from_store"] = after.get("hinted_from_store", 0) - before.get("hinted_from_store", 0)
    return out


def step_totals_delta(before: dict, after: dict) -> dict | None:
    """One replica's engine steps between two snapshots (app/engine/step_timing.py's totals): per kind of step its
    count, seconds, host seconds and sampled rows, with the mean step and rows per step; and the engine thread's
    gaps between steps with requests in the engine (wall and CPU seconds), and its work outside steps by name
    (commands, delivering outputs), most seconds first. None where a snapshot has no totals (an older engine)."""
    old, new = (s.get("step_timing", {}).get("totals") for s in (before, after))
    if old is None or new is None:
        return None
    out = {}
    for kind in ("decode", "mixed"):
        d = {k: new[kind][k] - old[kind].get(k, 0) for k in new[kind]}
        d["step_ms_mean"] = 1e3 * d["seconds"] / d["steps"] if d["steps"] else None
        d["rows_per_step"] = d["rows"] / d["steps"] if d["steps"] else None
        out[kind] = d
    gaps = {k: new["between"][k] - old["between"].get(k, 0.0) for k in new["between"]}
    gaps["ms_mean"] = 1e3 * gaps["seconds"] / gaps["gaps"] if gaps["gaps"] else None
    out["between"] = gaps
    work = {}
    for name, after in new.get("work", {}).items():
        was = old.get("work", {}).get(name, {})
        d = {k: after[k] - was.get(k, 0) for k in ("count", "seconds", "cpu_seconds")}
        if d["count"]:
            work[name] = {**d, "ms_mean": 1e3 * d["seconds"] / d["count"], "max_ms_since_start": after["max_ms"]}
    out["work"] = dict(sorted(work.items(), key=lambda item: -item[1]["seconds"]))
    if "gc" in new:
        out["gc"] = {g: {k: new["gc"][g][k] - old.get("gc", {}).get(g, {}).get(k, 0) for k in ("count", "seconds")}
                     for g in new["gc"]}
    return out


def sum_deltas(deltas: list[dict]) -> dict:
    """The replicas' bench.engine.driver.metrics_delta results added up (the counters of the whole deployment),
    with their remote_delta results where they carry them ("remote")."""
    out = {k: sum(d[k] for d in deltas) for k in (*COUNTERS, "steps")}
    if deltas and all("remote" in d for d in deltas):
        out["remote"] = {k: sum(d["remote"][k] for d in deltas) for k in deltas[0]["remote"]}
    for name in HISTOGRAMS:
        out[name] = _histogram_sum([d[name] for d in deltas])
    out["tiers"] = {tier: {f: sum(d["tiers"][tier][f] for d in deltas) for f in fields}
                    for tier, fields in (("disk_to_host", ("bytes", "seconds", "reads", "cache_hits")),
                                         ("host_to_device", ("bytes", "seconds")))}
    h2d = out["tiers"]["host_to_device"]
    h2d["gb_per_s"] = h2d["bytes"] / h2d["seconds"] / 1e9 if h2d["seconds"] > 0 else None
    return out


@dataclass
class RequestResult:
    """One HTTP request of a run, as the client saw it (seconds after the run's start)."""
    adapter: str | None
    scheduled_s: float
    sent_s: float = 0.0
    ok: bool = False
    status: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    chunk_s: list[float] | None = None
    tokens: int = 0
    replica: str | None = None


def router_wait(samples: list[tuple[int, int]]) -> dict:
    """samples: (requests in flight at the client, running + waiting over the replicas) every poll."""
    waiting = [max(0, inflight - at_replicas) for inflight, at_replicas in samples]
    return {"samples": len(waiting), "mean": float(np.mean(waiting)) if waiting else None,
            "max": max(waiting, default=None),
            "share_of_samples_waiting": sum(w > 0 for w in waiting) / len(waiting) if waiting else None}


def mean_of(histogram: dict) -> float | None:
    return histogram["sum"] / histogram["count"] if histogram["count"] else None


def hinted_hit_rate(delta: dict) -> float | None:
    hinted = delta["hinted_on_device"] + delta["hinted_in_host"] + delta["hinted_from_disk"]
    hinted += delta.get("remote", {}).get("hinted_from_store", 0)
    return delta["hinted_on_device"] / hinted if hinted else None


def remote_summary(delta: dict) -> dict | None:
    """The node cache over a run (see REMOTE_NOTES); None where the adapters were local."""
    remote = delta.get("remote")
    if remote is None:
        return None
    on_node = delta["hinted_on_device"] + delta["hinted_in_host"] + delta["hinted_from_disk"]
    hinted = on_node + remote["hinted_from_store"]
    requested = remote.get("adapters_requested")
    extra = None if requested is None else remote["downloads"] - requested
    wasted = None if extra is None else max(extra, 0) * remote["downloaded_bytes"] // max(remote["downloads"], 1)
    return {"fetched_bytes": remote["downloaded_bytes"], "downloads": remote["downloads"],
            "adapters_requested": requested,
            "extra_downloads": extra, "wasted_remote_bytes": wasted,
            "wasted_remote_share": None if wasted is None else wasted / max(remote["downloaded_bytes"], 1),
            "download_s_mean": remote["download_seconds"] / remote["downloads"] if remote["downloads"] else None,
            "cache_hits": remote["hits"], "waited_for_other": remote["waited_for_other"],
            "evictions": remote["evictions"], "fetched_ahead": remote["fetched_ahead"],
            "fetched_ahead_used": remote["fetched_ahead_used"],
            "wasted_fetches": remote["fetched_ahead"] - remote["fetched_ahead_used"],
            "wasted_fetch_bytes": remote["fetched_ahead_bytes"] - remote["fetched_ahead_used_bytes"],
            "hinted_from_store": remote["hinted_from_store"],
            "hinted_on_node_share": on_node / hinted if hinted else None}


def remote_line(s: dict) -> str:
    """The remote figures of a run's summary, for the printed table ("" where the adapters were local)."""
    r = s.get("remote")
    if r is None:
        return ""
    share = "n/a" if r["hinted_on_node_share"] is None else f"{r['hinted_on_node_share']:.2f}"
    return (f"; remote: {r['fetched_bytes'] / 1e9:.2f} GB in {r['downloads']} downloads for "
            f"{r['adapters_requested']} adapters requested, {r['wasted_fetches']} fetched ahead and not read "
            f"by the replica that fetched them ({r['wasted_fetch_bytes'] / 1e9:.2f} GB), wasted "
            f"{(r['wasted_remote_bytes'] or 0) / 1e9:.2f} GB, hinted on node {share}")


def summarize(results: list[RequestResult], delta: dict, per_replica: dict[str, dict], hints_pushed: int,
              samples: list[tuple[int, int]]) -> dict:
    """One run's numbers, with the engine bench's names (bench/stats.py) where they mean the same thing."""
    done = [r for r in results if r.ok]
    ttft = [r.first_token_s - r.scheduled_s for r in done if r.first_token_s is not None]
    e2e = [r.finished_s - r.scheduled_s for r in done]
    itl = [b - a for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    span = max(max((r.finished_s for r in done), default=0.0) - min((r.scheduled_s for r in results), default=0.0),
               1e-9)
    kinds = {"hit": delta["hint_hits"], "inflight": delta["inflight_hits"], "miss": delta["misses"]}
    lead = delta["hint_lead_seconds"]
    by_replica = Counter(r.replica for r in done)
    adapters_on = {}
    for r in done:
        adapters_on.setdefault(r.adapter, set()).add(r.replica)
    return {
        "requests": len(results), "completed": len(done),
        "statuses": {str(s): n for s, n in sorted(Counter(r.status for r in results).items())},
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
        "request_throughput_per_s": len(done) / span, "token_throughput_per_s": sum(r.tokens for r in done) / span,
        "send_lag_s_max": max((r.sent_s - r.scheduled_s for r in results), default=None),
        "stall_s_per_request": delta["stall_seconds"]["sum"] / max(len(results), 1),
        "stalls": delta["stall_seconds"]["count"],
        "hint_hit_rate": hit_rate([k for k, n in kinds.items() for _ in range(n)]),
        "hint_hit_rate_when_queued": hinted_hit_rate(delta),
        "hinted_arrivals": {"device": delta["hinted_on_device"], "host": delta["hinted_in_host"],
                            "disk": delta["hinted_from_disk"],
                            **({"store": delta["remote"]["hinted_from_store"]} if "remote" in delta else {})},
        "remote": remote_summary(delta),
        "arrival_kinds": kinds,
        "hint_lead_s_mean": mean_of(lead),
        "adapter_wait_s_mean": mean_of(delta["adapter_wait_seconds"]),
        "adapter_wait_before_load_s_mean": mean_of(delta["adapter_wait_before_load_seconds"]),
        "adapter_wait_histogram": delta["adapter_wait_seconds"],
        "replica_first_token_s_mean": mean_of(delta["first_token_seconds"]),
        "replica_request_s_mean": mean_of(delta["request_seconds"]),
        "hint_lead_histogram": lead,
        "hints_received": delta["hints_received"], "hints_late": delta["hints_late"],
        "hints_duplicate": delta["hints_duplicate"], "hints_pushed": hints_pushed,
        "router_wait": router_wait(samples),
        "wasted_prefetch_bytes": delta["wasted_prefetch_bytes"],
        "wasted_prefetch_bytes_evicted": delta["wasted_prefetch_bytes"], "unused_resident_bytes_at_end": None,
        "wasted_prefetches": delta["wasted_prefetches"], "loads": delta["loads_started"],
        "evictions": delta["evictions"], "h2d_gb_per_s": delta["tiers"]["host_to_device"]["gb_per_s"],
        "tiers": delta["tiers"], "steps": delta["steps"],
        "requests_per_replica": dict(by_replica),
        "replicas_per_adapter_mean": float(np.mean([len(v) for v in adapters_on.values()])) if adapters_on else None,
        "per_replica": per_replica,
        "replica_per_request": [r.replica for r in results],  # in trace order (the x-replica-id header)
        "ttft_samples_s": sorted(ttft),
    }
