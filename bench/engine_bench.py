"""In-process engine benchmark: do hints + async prefetch into S slots hide adapter loading better
than plain LRU with 2S slots? Drives LLMEngine in real time (open loop) with seeded traces.

    python -m bench.engine_bench --quick                         # make bench: CPU, small demo, < 10 min
    python -m bench.engine_bench --size small --slots 4 --workload uniform zipf --rate 3
    bash bench/device/gpu_engine_bench.sh                        # 1 x H100, Llama-3-8B shapes, one call

Arms (bench/arms.py): A prefetch + hints, S slots; B LRU with synchronous loads, 2S slots; C
synchronous loads, S slots; D all adapters resident (N <= S only); E the base model alone.
Every run starts with empty slots and an empty host cache. A and B run first, workload by
workload, so a run cut short by --time-budget-s still holds the main comparison.
One JSON per workload lands in bench/results/<device>-engine-<workload>.json, PNGs beside it.

Request counts. --quick (CPU, small demo, S = 4, N = 4 and 16, uniform / zipf / bursty-cv4): a
32-request saturation burst, then 6 s of arrivals a run at 75% of the saturating rate, lengths x 1/16.
The H100 script (bench/device/gpu_engine_bench.sh; Llama-3-8B shapes, S = 8) runs 40 requests a run
with lengths x 1/4, and splits the workloads over several calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from app.config import EngineConfig
from app.demo import SIZES
from bench import plots
from bench.adapter_pool import prepare
from bench.arms import ARMS, Engines, play
from bench.common import RESULTS, write_result
from bench.driver import vocab_ids
from bench.stats import summarize
from bench.workloads import LENGTH_MODES, WORKLOADS, make

SATURATION_REQUESTS = 32  # the saturation burst: at least this many requests, or twice the batch
BURST_RATE = 1e6  # requests/s: every request of the burst arrives at once
SWITCH_INTERVAL_S = 0.0005  # what deploy/replica.py sets, so engine and loader threads share the GIL as there
# make bench: the small demo on CPU. The host cache holds about 3S packed adapters (60 MB / 4.8 MB), the
# ratio of the engine's 2 GiB default to 84 MB Llama-3-8B adapters at S = 8, so disk reads still happen.
QUICK = dict(size="small", slots=4, n_values=[4, 16], workload=["uniform", "zipf", "bursty-cv4"], sweep=True,
             duration_s=6.0, length_scale=0.0625, rotate_s=2.0,
             host_cache_mb=60.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"the make-bench preset: {QUICK}")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--demo-dir", type=Path, help="a built demo to use instead of demo/<size> (tiny/small)")
    p.add_argument("--base", type=Path, help="llama3-8b-shape: a saved base model folder (default: build one)")
    p.add_argument("--slots", type=int, default=4, help="S: device slots of arms A and C")
    p.add_argument("--n-values", type=int, nargs="+", help="adapter counts N (default: S/2 S 2S 4S 16S)")
    p.add_argument("--workload", nargs="+", default=["uniform"], help=f"'all' or some of {list(WORKLOADS)}")
    p.add_argument("--arms", default="ABCDE", help="which arms to run, e.g. ABE")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="requests per second")
    rate.add_argument("--sweep", action="store_true", help="measure arm A's saturating rate (a burst), run at 75%% of it")
    p.add_argument("--duration-s", type=float, default=10.0, help="arrival window of each run")
    p.add_argument("--requests", type=int, help="requests per run (overrides --duration-s)")
    p.add_argument("--lengths", default="slora", choices=LENGTH_MODES)
    p.add_argument("--length-scale", type=float, default=1.0, help="scale prompt and output lengths (CPU)")
    p.add_argument("--hint-lead-s", type=float, default=0.05, help="arm A's hint lead; 0 disables explicit hints")
    p.add_argument("--idle-poll-s", type=float, default=0.0,
                   help="sleep this long between steps while only loads are in flight (0: step on, as AsyncEngine)")
    p.add_argument("--switch-interval-s", type=float, default=SWITCH_INTERVAL_S,
                   help="sys.setswitchinterval for the run (the replica's setting by default)")
    p.add_argument("--rotate-s", type=float, default=2.0, help="bursty: seconds between hot-set moves")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--host-cache-mb", type=float, help="host cache budget (default: the engine's)")
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
    unknown = set(args.workload) - set(WORKLOADS) | set(args.arms) - set(ARMS)
    if unknown:
        p.error(f"unknown workloads or arms {sorted(unknown)}")
    s = args.slots
    args.n_values = sorted(set(args.n_values or [max(1, s // 2), s, 2 * s, 4 * s, 16 * s]))
    return args


def result_name(args, workload: str) -> str:
    """engine-<workload>, plus -fixed for the 512 in / 128 out lengths, so both length modes keep a file."""
    return f"engine-{workload}" + ("-fixed" if args.lengths == "fixed" else "")


def run_count(args, workload: str, rate: float) -> int:
    """Requests per run: --requests, or rate x --duration-s; distinct stops at the largest N (one adapter each)."""
    count = args.requests or max(4, round(rate * args.duration_s))
    return min(count, max(args.n_values)) if workload == "distinct" else count


def plan_runs(args, rate: float) -> list[tuple[str, int, str]]:
    """(workload, N, arm) in the order to run them.

    A and B first (two engines stay alive), then the arms on C's engine (C, D at N = S, E), then D
    at smaller N. E runs once per workload: it ignores N. distinct has one N, its request count.
    """
    runs = []
    for workload in args.workload:
        ns = [run_count(args, workload, rate)] if workload == "distinct" else args.n_values
        for n in ns:
            runs += [(workload, n, arm) for arm in args.arms if arm != "E" and ARMS[arm].applies(args.slots, n)]
        if "E" in args.arms:
            runs.append((workload, ns[0], "E"))
    c_key = ARMS["C"].engine_key(args.slots, 0)

    def order(run):
        workload, n, arm = run
        key = ARMS[arm].engine_key(args.slots, n)
        phase = 0 if arm in "AB" else 1 if key == c_key else 2
        return phase, key if phase == 2 else (), args.workload.index(workload), n, "ABCDE".index(arm)

    return sorted(runs, key=order)


def sweep(args, engine, names, vocab) -> dict:
    """Arm A's saturating rate (uniform, the middle N): a burst of SATURATION_REQUESTS requests that all
    arrive at once, finished requests per second of the burst's wall time. The benchmark runs at 75% of it.

    An earlier version raised the rate step by step and called a step saturated when it finished fewer
    requests per second than it offered; on the H100 a request outlived the short arrival window, so the
    drain alone failed that test at the first step and the runs went at a quarter of the real capacity.
    """
    workload, n = "uniform", args.n_values[len(args.n_values) // 2]
    count = max(SATURATION_REQUESTS, 2 * args.max_batch_size)
    arrivals = make(workload, n, count, BURST_RATE, args.seed, args.lengths, args.length_scale, args.slots)
    record = play(engine, ARMS["A"], arrivals, names, n, vocab, args.seed, args.hint_lead_s,
                  idle_poll_s=args.idle_poll_s)
    summary = summarize(record)
    saturating = summary["request_throughput_per_s"]
    return {"workload": workload, "n": n, "requests": count, "wall_s": record.wall_s,
            "token_throughput_per_s": summary["token_throughput_per_s"],
            "saturating_rate": saturating, "rate": 0.75 * saturating}


def payload(args, workload: str, by_n: dict, rate: float, sweep_info, engines: Engines, timings: dict,
            skipped: list) -> dict:
    skipped_here = [{"n": n, "arm": arm} for w, n, arm in skipped if w == workload]
    return {
        "benchmark": "engine", "complete": "total" in timings and not skipped_here, "skipped_runs": skipped_here,
        "workload": workload, "workload_spec": asdict(WORKLOADS[workload]), "size": args.size,
        "model": engines.shape, "slots": args.slots, "n_values": sorted(int(n) for n in by_n),
        "arms": {a: ARMS[a].label for a in args.arms},
        "rate": rate, "rate_source": "sweep" if args.sweep else "fixed", "sweep": sweep_info,
        "requests_per_run": run_count(args, workload, rate), "lengths": args.lengths,
        "length_scale": args.length_scale, "hint_lead_s": args.hint_lead_s, "idle_poll_s": args.idle_poll_s,
        "switch_interval_s": args.switch_interval_s,
        "rotate_s": args.rotate_s, "seeds": {"trace": args.seed, "prompts": args.seed, "adapters": args.seed},
        "max_batch_size": args.max_batch_size, "host_cache_bytes": engines.config.host_cache_bytes,
        "quick": args.quick, "timings_s": {**timings, "engine_builds": engines.build_s}, "results": by_n,
    }


def main(argv=None) -> list[Path]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # one bar per engine build would break up ours
    previous = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval_s)
    try:
        return run(args)
    finally:
        sys.setswitchinterval(previous)


def run(args) -> list[Path]:
    started = time.perf_counter()
    base, adapter_dir, names = prepare(args.size, max(args.n_values), args.seed, args.demo_dir, args.base)
    timings = {"prepare": time.perf_counter() - started}
    config = EngineConfig(base_model=str(base), adapter_roots=(str(adapter_dir),), num_slots=args.slots,
                          max_rank=16, max_batch_size=args.max_batch_size,
                          **({"host_cache_bytes": int(args.host_cache_mb * 2**20)} if args.host_cache_mb else {}))
    engines = Engines(config, names, adapter_dir)
    rate, sweep_info = args.rate, None
    if args.sweep:
        engine = engines.get(ARMS["A"].engine_key(args.slots, 0))
        sweep_info = sweep(args, engine, names, vocab_ids(engine.tokenizer))
        rate = sweep_info["rate"]
        timings["sweep"] = time.perf_counter() - started - timings["prepare"]
    results: dict[str, dict] = {w: {} for w in args.workload}
    runs, skipped = plan_runs(args, rate), []
    base_runs: dict[tuple, dict] = {}  # E's trace -> its summary: workloads that share a trace share E
    bar = tqdm(total=sum(run_count(args, w, rate) for w, _, _ in runs), unit="req")
    last_wall = 0.0
    for workload, n, arm_name in runs:
        arm, key = ARMS[arm_name], ARMS[arm_name].engine_key(args.slots, n)
        count = run_count(args, workload, rate)
        needed = max(last_wall, count / rate) + (0 if key in engines.alive else max(engines.build_s, default=0))
        if args.time_budget_s and time.perf_counter() - started + needed > args.time_budget_s:
            skipped.append((workload, n, arm_name))
            continue
        engine = engines.get(key)
        bar.set_description(f"{workload} N={n} {arm_name}")
        arrivals = make(workload, n, count, rate, args.seed, args.lengths, args.length_scale, args.slots, args.rotate_s)
        trace = tuple((a.t_s, a.prompt_len, a.output_len) for a in arrivals)
        if arm.base_only and trace in base_runs:
            summary = {**base_runs[trace], "same_trace_as": base_runs[trace]["workload"]}
            bar.update(len(arrivals))
        else:
            record = play(engine, arm, arrivals, names, n, vocab_ids(engine.tokenizer), args.seed, args.hint_lead_s,
                          on_finish=lambda: bar.update(1), idle_poll_s=args.idle_poll_s)
            summary = {**summarize(record), "slots": key[0], "workload": workload}
            last_wall = record.wall_s
            if arm.base_only:
                base_runs[trace] = summary
        results[workload].setdefault(str(n), {})[arm_name] = summary
        # Written after every run, so a run killed from outside still leaves what it measured.
        write_result(result_name(args, workload), payload(args, workload, results[workload], rate, sweep_info, engines,
                                                   {**timings, "elapsed": time.perf_counter() - started}, skipped),
                     args.results_dir)
    bar.close()
    engines.close()
    for by_n in results.values():  # E ignores N: show its one run under every N
        e = next((arms["E"] for arms in by_n.values() if "E" in arms), None)
        for arms in by_n.values():
            if e is not None:
                arms["E"] = e
    timings["total"] = time.perf_counter() - started
    paths = [write_result(result_name(args, w), payload(args, w, by_n, rate, sweep_info, engines, timings, skipped),
                          args.results_dir) for w, by_n in results.items() if by_n]
    if not args.no_plots:
        for path in paths:
            plots.plot_result(path)
    print(f"wrote {len(paths)} results in {timings['total']:.0f}s ({len(skipped)} runs skipped for time):",
          *map(str, paths), sep="\n  ")
    return paths


if __name__ == "__main__":
    main()
