"""Engine benchmark: does async prefetch with hints serve N adapters better than plain LRU, at the same
device adapter memory M? Drives LLMEngine in real time (open loop) with seeded traces.

    python -m bench.engine.hints --quick                   # make bench: CPU, small demo, a few minutes
    python -m bench.engine.hints --size small --capacity 4 --workload uniform sequential --sweep
    bash bench/device/engine_hints.sh                      # 1 x H100, Llama-3-8B shapes (see the script)

Arms (bench/engine/arms.py), one engine, so every arm has the same adapter pool (M bytes), host arena and KV cache:
  B   LRU, synchronous loads on a miss (no prefetch, no hints)
  A0  asynchronous prefetch planned from the engine's own waiting queue (S-LoRA's policy), no hints
  A   A0 plus hints: the driver calls engine.hint([adapter]) --hint-lead-s before each arrival
  D   every adapter resident before the clock starts (only where the N adapters fit in M)
M is --capacity K max-rank adapters, converted to bytes once (or --adapter-memory-mb); the pool holds more
adapters than K when ranks are smaller. N defaults to K/2, K, 4K and 16K; distinct uses N = its request
count, sequential N = 50 (workloads in bench/workloads.py).

Host tier. By default the host cache holds every adapter and is filled before the first run, so a load
is a host->device copy. With --host-cache-adapters X it holds X max-rank adapters (fewer than the working
set) and is emptied before each run, so disk reads are part of what hints must hide (results named
claim-<workload>-disk); --cold-disk also drops the adapter files from the OS page cache before each run.

Rate: --rate, or --sweep: arm D's saturating rate (uniform, N = K, all requests at once), times --load.
One JSON per workload lands in bench/results/<device>-claim-<workload>[-disk].json, PNGs beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from app.engine.async_engine import SWITCH_INTERVAL_S  # what a replica sets: engine and loader threads share the GIL
from app.engine.config import EngineConfig
from app.demo.build import SIZES
from app.adapters.targets import target_shapes
from bench.adapter_pool import prepare
from bench.common import RESULTS, write_result
from bench.engine import plots
from bench.engine.arms import (ARMS, build_engine, close_engine, drop_page_cache, fits, model_shape, play, pool_info,
                               warm_host)
from bench.engine.driver import vocab_ids
from bench.stats import summarize
from bench.workloads import LENGTH_MODES, SEQUENTIAL_ADAPTERS, SEQUENTIAL_REQUESTS, WORKLOADS, make
from prefetch.layout import PageLayout

SATURATION_REQUESTS = 32  # the saturation burst: at least this many requests, or twice the batch
BURST_RATE = 1e6  # requests/s: every request of the burst arrives at once
QUICK = dict(size="small", capacity=4, n_values=[2, 4, 16], workload=["uniform", "zipf", "bursty-cv4", "sequential"],
             sweep=True, duration_s=3.0, sequential_requests=24, length_scale=0.0625, rotate_s=2.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"the make-bench preset: {QUICK}")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--demo-dir", type=Path, help="a built demo to use instead of demo/<size> (tiny/small)")
    p.add_argument("--base", type=Path, help="llama3-8b-shape: a saved base model folder (default: build one)")
    p.add_argument("--capacity", type=int, default=4, help="K: device adapter memory M in max-rank adapters")
    p.add_argument("--adapter-memory-mb", type=float, help="M in MiB instead (capacity then only sets default N)")
    p.add_argument("--n-values", type=int, nargs="+", help="adapter counts N (default: K/2 K 4K 16K)")
    p.add_argument("--workload", nargs="+", default=["uniform"],
                   help=f"'all' or some of {list(WORKLOADS)}; name@N1,N2 runs that workload at those N only")
    p.add_argument("--arms", nargs="+", default=list(ARMS), help=f"which arms to run, of {list(ARMS)}")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="requests per second")
    rate.add_argument("--sweep", action="store_true", help="measure arm D's saturating rate, run at --load of it")
    p.add_argument("--load", type=float, default=0.75, help="--sweep: the fraction of the saturating rate to run at")
    p.add_argument("--duration-s", type=float, default=10.0, help="arrival window of each run")
    p.add_argument("--requests", type=int, help="requests per run (overrides --duration-s)")
    p.add_argument("--sequential-requests", type=int, default=SEQUENTIAL_REQUESTS,
                   help="requests of a sequential run (3 phases; 300 is the seed review's)")
    p.add_argument("--lengths", default="slora", choices=LENGTH_MODES)
    p.add_argument("--length-scale", type=float, default=1.0, help="scale prompt and output lengths (CPU)")
    p.add_argument("--hint-lead-s", type=float, default=0.05, help="arm A's hint lead")
    p.add_argument("--idle-poll-s", type=float, default=0.0,
                   help="sleep this long between steps while only loads are in flight (0: step on, as AsyncEngine)")
    p.add_argument("--switch-interval-s", type=float, default=SWITCH_INTERVAL_S,
                   help="sys.setswitchinterval for the run (the replica's setting by default)")
    p.add_argument("--rotate-s", type=float, default=2.0, help="bursty: seconds between hot-set moves")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--host-cache-adapters", type=float,
                   help="host cache in max-rank adapters, emptied before each run (default: all adapters, kept warm)")
    p.add_argument("--cold-disk", action="store_true",
                   help="drop the adapter files from the OS page cache before each run")
    p.add_argument("--time-budget-s", type=float, help="start no run that would end past this; write what ran")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.rate = None
    if args.rate is None and not args.sweep:
        p.error("give --rate or --sweep (or --quick)")
    if args.workload == ["all"]:
        args.workload = list(WORKLOADS)
    k = args.capacity
    args.n_values = sorted(set(args.n_values or [max(1, k // 2), k, 4 * k, 16 * k]))
    args.n_by_workload = {}
    for item in args.workload:
        name, _, ns = item.partition("@")
        args.n_by_workload[name] = sorted({int(n) for n in ns.split(",")}) if ns else args.n_values
    args.workload = list(args.n_by_workload)
    unknown = set(args.workload) - set(WORKLOADS) | set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown workloads or arms {sorted(unknown)}")
    return args


def result_name(args, workload: str) -> str:
    return (f"claim-{workload}" + ("-disk" if args.host_cache_adapters is not None else "")
            + ("-fixed" if args.lengths == "fixed" else ""))


def run_count(args, workload: str, rate: float) -> int:
    """Requests per run: --requests, or rate x --duration-s; distinct stops at the largest N (one adapter each)."""
    if workload == "sequential":
        return args.sequential_requests
    count = args.requests or max(4, round(rate * args.duration_s))
    return min(count, max(args.n_by_workload[workload])) if workload == "distinct" else count


def n_values(args, workload: str, rate: float) -> list[int]:
    if workload == "sequential":
        return [SEQUENTIAL_ADAPTERS]
    return [run_count(args, workload, rate)] if workload == "distinct" else args.n_by_workload[workload]


def max_rank_adapter_bytes(config: EngineConfig) -> int:
    """Bytes of one max_rank adapter in the engine's page layout (the unit of --capacity)."""
    model = AutoConfig.from_pretrained(config.base_model)
    shapes = {m: s for m, s in target_shapes(model).items() if m.rsplit(".", 1)[1] in config.target_modules}
    layout = PageLayout(shapes, config.max_rank, config.adapter_page_rows)
    return layout.adapter_nbytes(config.max_rank, config.torch_dtype(config.torch_device()))


def engine_config(args, base: Path, adapter_dir: Path, num_adapters: int) -> EngineConfig:
    config = EngineConfig(base_model=str(base), adapter_roots=(str(adapter_dir),), max_rank=16,
                          max_batch_size=args.max_batch_size)
    unit = max_rank_adapter_bytes(config)
    memory = int(args.adapter_memory_mb * 2**20) if args.adapter_memory_mb else args.capacity * unit
    host_adapters = num_adapters if args.host_cache_adapters is None else args.host_cache_adapters
    return replace(config, adapter_memory_bytes=memory, host_cache_bytes=max(unit, int(host_adapters * unit)))


def sweep(args, engine, names, vocab, held: int) -> dict:
    """Arm D's saturating rate (uniform, N = K, every adapter resident): a burst of SATURATION_REQUESTS
    requests that all arrive at once, finished requests per second of its wall time. Runs go at --load of it."""
    workload, n = "uniform", min(args.capacity, held)
    count = max(SATURATION_REQUESTS, 2 * args.max_batch_size)
    arrivals = make(workload, n, count, BURST_RATE, args.seed, args.lengths, args.length_scale, args.capacity)
    record = play(engine, ARMS["D"], arrivals, names, n, vocab, args.seed, args.hint_lead_s, keep_host=True,
                  idle_poll_s=args.idle_poll_s)
    summary = summarize(record)
    saturating = summary["request_throughput_per_s"]
    return {"workload": workload, "n": n, "arm": "D", "requests": count, "wall_s": record.wall_s,
            "token_throughput_per_s": summary["token_throughput_per_s"],
            "saturating_rate": saturating, "load": args.load, "rate": args.load * saturating}


def plan_runs(args, engine, names, rate: float) -> list[tuple[str, int, str]]:
    """(workload, N, arm) in the order given: workload by workload, N by N, the arms in --arms order."""
    return [(w, n, arm) for w in args.workload for n in n_values(args, w, rate) for arm in args.arms
            if not ARMS[arm].preload or fits(engine, names[:n])]


def adapters_held(engine, names) -> int:
    """How many of the benchmark's adapters, in order, fit in M at once."""
    return next((n for n in range(1, len(names) + 1) if not fits(engine, names[:n])), len(names) + 1) - 1


def payload(args, workload: str, by_n: dict, rate: float, run: dict, timings: dict, skipped: list) -> dict:
    skipped_here = [{"n": n, "arm": arm} for w, n, arm in skipped if w == workload]
    pool = run["pool"]
    return {
        "benchmark": "claim", "complete": "total" in timings and not skipped_here, "skipped_runs": skipped_here,
        "workload": workload, "workload_spec": asdict(WORKLOADS[workload]), "size": args.size, "model": run["shape"],
        "variant": "disk" if args.host_cache_adapters is not None else "warm-host",
        # The memory every arm gets: the pool the engine allocated for M, and the host arena.
        "capacity": args.capacity, "adapter_memory_bytes": pool["adapter_memory_bytes"],
        "adapter_memory_bytes_asked": run["config"].adapter_memory_bytes, "pool": pool,
        "adapters_m_holds": run["held"], "host_cache_bytes": pool["host_arena_bytes"],
        "host_cache_adapters": args.host_cache_adapters, "host_cached_at_start": run["host_cached"],
        "cold_disk": args.cold_disk, "n_values": sorted(int(n) for n in by_n),
        "arms": {a: {**ARMS[a].config(), "adapter_memory_bytes": pool["adapter_memory_bytes"],
                     "host_cache_bytes": pool["host_arena_bytes"],
                     "hint_lead_s": args.hint_lead_s if ARMS[a].hints else None} for a in args.arms},
        "rate": rate, "rate_source": "sweep" if args.sweep else "fixed", "sweep": run["sweep"],
        "requests_per_run": run_count(args, workload, rate), "lengths": args.lengths,
        "length_scale": args.length_scale, "hint_lead_s": args.hint_lead_s, "idle_poll_s": args.idle_poll_s,
        "switch_interval_s": args.switch_interval_s, "rotate_s": args.rotate_s,
        "seeds": {"trace": args.seed, "prompts": args.seed, "adapters": args.seed},
        "max_batch_size": args.max_batch_size, "quick": args.quick, "timings_s": timings, "results": by_n,
    }


def main(argv=None) -> list[Path]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval_s)
    try:
        return run(args)
    finally:
        sys.setswitchinterval(previous)


def run(args) -> list[Path]:
    started = time.perf_counter()
    needed = max([args.capacity, *(n for ns in args.n_by_workload.values() for n in ns),
                  *[SEQUENTIAL_ADAPTERS] * ("sequential" in args.workload)])
    base, adapter_dir, names = prepare(args.size, needed, args.seed, args.demo_dir, args.base)
    timings = {"prepare": time.perf_counter() - started}
    config = engine_config(args, base, adapter_dir, len(names))
    engine = build_engine(config, None, True, names, adapter_dir)
    timings["engine_build"] = time.perf_counter() - started - timings["prepare"]
    keep_host = args.host_cache_adapters is None
    run_info = {"config": config, "pool": pool_info(engine), "shape": model_shape(engine),
                "held": adapters_held(engine, names), "sweep": None,
                "host_cached": warm_host(engine, names) if keep_host else 0}
    vocab = vocab_ids(engine.tokenizer)
    rate = args.rate
    if args.sweep:
        run_info["sweep"] = sweep(args, engine, names, vocab, run_info["held"])
        rate = run_info["sweep"]["rate"]
    timings["setup"] = time.perf_counter() - started
    results: dict[str, dict] = {w: {} for w in args.workload}
    runs, skipped = plan_runs(args, engine, names, rate), []
    bar = tqdm(total=sum(run_count(args, w, rate) for w, _, _ in runs), unit="req")
    last_wall = 0.0
    for workload, n, arm_name in runs:
        count = run_count(args, workload, rate)
        if args.time_budget_s and time.perf_counter() - started + max(last_wall, count / rate) > args.time_budget_s:
            skipped.append((workload, n, arm_name))
            continue
        bar.set_description(f"{workload} N={n} {arm_name}")
        arrivals = make(workload, n, count, rate, args.seed, args.lengths, args.length_scale, args.capacity,
                        args.rotate_s)
        if args.cold_disk:
            drop_page_cache(adapter_dir, names[:n])
        record = play(engine, ARMS[arm_name], arrivals, names, n, vocab, args.seed, args.hint_lead_s, keep_host,
                      on_finish=lambda: bar.update(1), idle_poll_s=args.idle_poll_s)
        last_wall = record.wall_s
        pool = pool_info(engine)  # read back each run: every arm gets the same pool and arena
        results[workload].setdefault(str(n), {})[arm_name] = {
            **summarize(record), "adapter_memory_bytes": pool["adapter_memory_bytes"],
            "host_cache_bytes": pool["host_arena_bytes"]}
        # Written after every run, so a run killed from outside still leaves what it measured.
        write_result(result_name(args, workload), payload(args, workload, results[workload], rate, run_info,
                                                          {**timings, "elapsed": time.perf_counter() - started},
                                                          skipped), args.results_dir)
    bar.close()
    close_engine(engine)
    del engine
    timings["total"] = time.perf_counter() - started
    paths = [write_result(result_name(args, w), payload(args, w, by_n, rate, run_info, timings, skipped),
                          args.results_dir) for w, by_n in results.items() if by_n]
    if not args.no_plots:
        for path in paths:
            plots.plot_result(path)
    print(f"wrote {len(paths)} results in {timings['total']:.0f}s ({len(skipped)} runs skipped for time):",
          *map(str, paths), sep="\n  ")
    return paths


if __name__ == "__main__":
    main()
