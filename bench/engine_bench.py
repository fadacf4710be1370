"""In-process engine benchmark: do hints + async prefetch into S slots hide adapter loading better
than plain LRU with 2S slots? Drives LLMEngine in real time (open loop) with seeded traces.

    python -m bench.engine_bench --quick                         # make bench: CPU, small demo, < 10 min
    python -m bench.engine_bench --size small --slots 4 --workload uniform zipf --rate 3
    python -m bench.engine_bench --size llama3-8b-shape --slots 8 --workload all --sweep      # H100

Arms (see bench/arms.py): A prefetch + hints, S slots; B LRU, 2S slots; C sync loads, S slots;
D all adapters resident (N <= S only); E the base model alone. One JSON per workload lands in
bench/results/<device>-engine-<workload>.json, with PNGs beside it (bench/plots.py).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from app.config import EngineConfig
from app.demo import SIZES, ensure_demo
from bench import plots
from bench.adapter_pool import random_adapters, scaled_copies
from bench.arms import ARMS, build_engine, close_engine, play
from bench.common import REPO_DEMO, RESULTS, write_result
from bench.driver import vocab_ids
from bench.stats import summarize
from bench.workloads import LENGTH_MODES, WORKLOADS, make

GPU_SIZE = "llama3-8b-shape"
SWEEP_GROWTH = 1.5  # each sweep rate is this much above the last
SATURATION_GAIN = 1.1  # throughput that grows less than this per step has saturated
KEEP_UP = 0.8  # ... and so has one that finishes less than this share of the offered rate
SWEEP_MIN_REQUESTS = 16
SWEEP_MAX_STEPS = 12
# make bench: the small demo on CPU. The host cache holds about 3S packed adapters (60 MB / 4.8 MB), the
# ratio of the engine's 2 GiB default to 84 MB Llama-3-8B adapters at S = 8, so disk reads still happen.
QUICK = dict(size="small", slots=4, n_values=[4, 16], workload=["uniform", "zipf", "bursty-cv4"], sweep=True,
             duration_s=6.0, length_scale=0.0625, rotate_s=2.0, sweep_start=3.0, sweep_window_s=4.0,
             host_cache_mb=60.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"the make-bench preset: {QUICK}")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--demo-dir", type=Path, help="a built demo to use instead of demo/<size> (tiny/small)")
    p.add_argument("--base", type=Path, help=f"{GPU_SIZE}: a saved base model folder (default: build one)")
    p.add_argument("--slots", type=int, default=4, help="S: device slots of arms A and C")
    p.add_argument("--n-values", type=int, nargs="+", help="adapter counts N (default: S/2 S 2S 4S 16S)")
    p.add_argument("--workload", nargs="+", default=["uniform"], help=f"'all' or some of {list(WORKLOADS)}")
    p.add_argument("--arms", default="ABCDE", help="which arms to run, e.g. ABE")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="requests per second")
    rate.add_argument("--sweep", action="store_true", help="find arm A's saturating rate, run at 75%% of it")
    p.add_argument("--sweep-start", type=float, default=1.0, help="first sweep rate (requests/s)")
    p.add_argument("--sweep-window-s", type=float, default=5.0, help="arrival window of each sweep step")
    p.add_argument("--duration-s", type=float, default=10.0, help="arrival window of each run")
    p.add_argument("--requests", type=int, help="requests per run (overrides --duration-s)")
    p.add_argument("--lengths", default="slora", choices=LENGTH_MODES)
    p.add_argument("--length-scale", type=float, default=1.0, help="scale prompt and output lengths (CPU)")
    p.add_argument("--hint-lead-s", type=float, default=0.05, help="arm A's hint lead; 0 disables explicit hints")
    p.add_argument("--rotate-s", type=float, default=2.0, help="bursty: seconds between hot-set moves")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--host-cache-mb", type=float, help="host cache budget (default: the engine's)")
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


def prepare(args) -> tuple[Path, Path, list[str]]:
    """(base model folder, adapter folder, adapter names), building what is missing."""
    count = max(args.n_values)  # distinct runs at most this many requests, so it needs no more
    if args.size == GPU_SIZE:
        device = "cuda" if _cuda() else "cpu"
        base = args.base or ensure_demo(REPO_DEMO / f"{GPU_SIZE}-base", size=GPU_SIZE, adapters=0, device=device) / "base"
        adapter_dir = REPO_DEMO / f"{GPU_SIZE}-bench-adapters"
        return base, adapter_dir, random_adapters(base, count, adapter_dir, rank=16, seed=args.seed, device=device)
    demo = args.demo_dir or ensure_demo(REPO_DEMO / args.size, size=args.size)
    adapter_dir = demo.parent / f"{demo.name}-bench-adapters"
    return demo / "base", adapter_dir, scaled_copies(demo, count, adapter_dir)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def run_count(args, workload: str, rate: float) -> int:
    """Requests per run: --requests, or rate x --duration-s; distinct stops at the largest N (one adapter each)."""
    count = args.requests or max(4, round(rate * args.duration_s))
    return min(count, max(args.n_values)) if workload == "distinct" else count


def plan_runs(args, rate: float) -> list[tuple[str, int, str]]:
    """(workload, N, arm), grouped so each engine is built once, arm A's first (the sweep's engine).

    E runs once per workload: it ignores N. distinct has one N, its request count.
    """
    runs = []
    for workload in args.workload:
        ns = [run_count(args, workload, rate)] if workload == "distinct" else args.n_values
        for n in ns:
            runs += [(workload, n, arm) for arm in args.arms if arm != "E" and ARMS[arm].applies(args.slots, n)]
        if "E" in args.arms:
            runs.append((workload, ns[0], "E"))
    first = ARMS["A"].engine_key(args.slots, 0)
    order = {arm: i for i, arm in enumerate("ACDBE")}

    def key(run):
        engine_key = ARMS[run[2]].engine_key(args.slots, run[1])
        return engine_key != first, engine_key, order[run[2]]

    return sorted(runs, key=key)


def sweep(args, engine, names, vocab) -> dict:
    """Raise arm A's rate (uniform, the middle N) until it saturates; run the benchmark at 75% of that.

    A step has saturated when its throughput grew less than SATURATION_GAIN over the last step's
    (throughput stops growing), or fell below KEEP_UP of the rate the trace offered (the queue grows).
    The saturating rate is the best throughput seen.
    """
    workload, n = "uniform", args.n_values[len(args.n_values) // 2]
    steps, rate = [], args.sweep_start
    bar = tqdm(desc=f"sweep {workload} N={n} arm A", unit="rate", leave=False)
    while len(steps) < SWEEP_MAX_STEPS:
        count = max(SWEEP_MIN_REQUESTS, round(rate * args.sweep_window_s))
        arrivals = make(workload, n, count, rate, args.seed, args.lengths, args.length_scale, args.slots)
        summary = summarize(play(engine, ARMS["A"], arrivals, names, n, vocab, args.seed, args.hint_lead_s))
        offered = (count - 1) / max(arrivals[-1].t_s - arrivals[0].t_s, 1e-9)
        throughput = summary["request_throughput_per_s"]
        steps.append({"rate": rate, "offered": offered, "throughput": throughput, "requests": count,
                      "ttft_p50_s": summary["ttft_s"]["p50"], "e2e_p50_s": summary["e2e_s"]["p50"]})
        bar.update(1)
        bar.set_postfix(rate=f"{rate:.2f}", thr=f"{throughput:.2f}")
        stopped_growing = len(steps) > 1 and throughput < SATURATION_GAIN * steps[-2]["throughput"]
        if stopped_growing or throughput < KEEP_UP * offered:
            break
        rate *= SWEEP_GROWTH
    bar.close()
    saturating = max(s["throughput"] for s in steps)
    return {"workload": workload, "n": n, "window_s": args.sweep_window_s, "steps": steps,
            "saturating_rate": saturating, "rate": 0.75 * saturating}


def model_shape(engine) -> dict:
    c = engine.model_config
    return {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "vocab": c.vocab_size,
            "dtype": str(engine.dtype), "device": str(engine.device),
            "slot_bytes": engine.residency.layout.nbytes(engine.dtype)}


class Engines:
    """At most one engine alive at a time (an 8B base fills much of a GPU): built on demand, reused by key."""

    def __init__(self, config: EngineConfig, names: list[str], adapter_dir: Path):
        self.config, self.names, self.adapter_dir = config, names, adapter_dir
        self.engine, self.key, self.shape, self.build_s = None, None, None, []

    def get(self, key: tuple[int, bool]):
        if key != self.key:
            self.close()
            start = time.perf_counter()
            self.engine, self.key = build_engine(self.config, *key, self.names, self.adapter_dir), key
            self.build_s.append(time.perf_counter() - start)
            self.shape = self.shape or model_shape(self.engine)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine, self.key = self.engine, None, None
            close_engine(engine)


def payload(args, workload: str, by_n: dict, rate: float, sweep_info, engines: Engines, timings: dict,
            complete: bool) -> dict:
    return {
        "benchmark": "engine", "complete": complete, "workload": workload,
        "workload_spec": asdict(WORKLOADS[workload]), "size": args.size, "model": engines.shape,
        "slots": args.slots, "n_values": sorted(int(n) for n in by_n), "arms": {a: ARMS[a].label for a in args.arms},
        "rate": rate, "rate_source": "sweep" if args.sweep else "fixed", "sweep": sweep_info,
        "requests_per_run": run_count(args, workload, rate), "lengths": args.lengths,
        "length_scale": args.length_scale, "hint_lead_s": args.hint_lead_s, "rotate_s": args.rotate_s,
        "seeds": {"trace": args.seed, "prompts": args.seed, "adapters": args.seed},
        "max_batch_size": args.max_batch_size, "host_cache_bytes": engines.config.host_cache_bytes,
        "quick": args.quick, "timings_s": {**timings, "engine_builds": engines.build_s}, "results": by_n,
    }


def main(argv=None) -> list[Path]:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # one bar per engine build would break up ours
    started = time.perf_counter()
    base, adapter_dir, names = prepare(args)
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

    def write(complete: bool) -> list[Path]:
        timings["total"] = time.perf_counter() - started
        return [write_result(f"engine-{w}", payload(args, w, by_n, rate, sweep_info, engines, timings, complete),
                             args.results_dir) for w, by_n in results.items()]

    runs = plan_runs(args, rate)
    base_runs: dict[tuple, dict] = {}  # E's trace -> its summary: workloads that share a trace share E
    bar = tqdm(total=sum(run_count(args, w, rate) for w, _, _ in runs), unit="req")
    for workload, n, arm_name in runs:
        arm, key = ARMS[arm_name], ARMS[arm_name].engine_key(args.slots, n)
        if engines.key is not None and key != engines.key:
            write(complete=False)  # a long GPU run that is cut off still leaves what it measured
        engine = engines.get(key)
        bar.set_description(f"{workload} N={n} {arm_name}")
        arrivals = make(workload, n, run_count(args, workload, rate), rate, args.seed, args.lengths,
                        args.length_scale, args.slots, args.rotate_s)
        trace = tuple((a.t_s, a.prompt_len, a.output_len) for a in arrivals)
        if arm.base_only and trace in base_runs:
            summary = {**base_runs[trace], "same_trace_as": base_runs[trace]["workload"]}
            bar.update(len(arrivals))
        else:
            record = play(engine, arm, arrivals, names, n, vocab_ids(engine.tokenizer), args.seed, args.hint_lead_s,
                          on_finish=lambda: bar.update(1))
            summary = {**summarize(record), "slots": key[0], "workload": workload}
            if arm.base_only:
                base_runs[trace] = summary
        results[workload].setdefault(str(n), {})[arm_name] = summary
    bar.close()
    engines.close()
    for by_n in results.values():  # E ignores N: show its one run under every N
        e = next((arms["E"] for arms in by_n.values() if "E" in arms), None)
        for arms in by_n.values():
            if e is not None:
                arms["E"] = e
    paths = write(complete=True)
    if not args.no_plots:
        for path in paths:
            plots.plot_result(path)
    print(f"wrote {len(paths)} results in {time.perf_counter() - started:.0f}s:", *map(str, paths), sep="\n  ")
    return paths


if __name__ == "__main__":
    main()
