"""Where one engine decode step's time goes: wall time of `engine.step()`, the model forward inside it
(synchronized), and a cProfile table of the step's Python, for base-only rows and for rows on distinct
adapters at a few batch sizes.

    python -m bench.engine.step_profile --size llama3-8b-shape --batches 1 4 16 32      # GPU
    python -m bench.engine.step_profile --size small --batches 1 4                      # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from dataclasses import replace

import torch

from app.engine.config import EngineConfig
from app.demo.build import SIZES
from app.sampling.params import SamplingParams
from bench.adapter_pool import prepare
from bench.common import write_result
from bench.engine.arms import build_engine, close_engine, reset_residency


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_batch(engine, names, rows: int, with_adapters: bool, steps: int, context: int) -> dict:
    """Fill the batch with `rows` requests (each on its own adapter, or the base), then time decode steps."""
    reset_residency(engine, names)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        adapter = names[i % len(names)] if with_adapters else None
        engine.add_request([(7 * i + j) % 1000 + 10 for j in range(context)], adapter, params, f"p{i}")
    while engine.waiting or len(engine.running) < rows:  # admit and prefill everyone
        engine.step()
    forward_s = []
    original = engine.runner.execute  # the model forward inside a step

    def timed_forward(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        sync()
        forward_s.append(time.perf_counter() - start)
        return out

    engine.runner.execute = timed_forward
    step_s = []
    for _ in range(3):
        engine.step()  # warm
    forward_s.clear()
    profiler = cProfile.Profile()
    for i in range(steps):
        sync()
        start = time.perf_counter()
        if i >= steps // 2:
            profiler.enable()
        engine.step()
        profiler.disable()
        sync()
        step_s.append(time.perf_counter() - start)
    del engine.runner.execute  # back to the class's method
    for request in list(engine.requests.values()):
        engine.abort(request.request_id)
    while engine.has_work():
        engine.step()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    return {"rows": rows, "adapters": with_adapters, "context": context,
            "step_ms_median": 1e3 * statistics.median(step_s),
            "forward_ms_median": 1e3 * statistics.median(forward_s),
            "profile_tottime_top": text.getvalue().splitlines()[-24:]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=64)
    args = p.parse_args(argv)
    base, adapter_dir, names = prepare(args.size, args.slots)
    config = EngineConfig(base_model=str(base), adapter_roots=(str(adapter_dir),), num_slots=args.slots,
                          max_rank=16, max_batch_size=max(args.batches))
    engine = build_engine(replace(config), args.slots, True, names, adapter_dir)
    results = []
    for rows in args.batches:
        for with_adapters in (False, True):
            r = profile_batch(engine, names, rows, with_adapters, args.steps, args.context)
            results.append(r)
            print(f"rows {rows:3d} {'adapters' if with_adapters else 'base    '}: step {r['step_ms_median']:.1f} ms, "
                  f"forward {r['forward_ms_median']:.1f} ms", flush=True)
    print("\n".join(results[-1]["profile_tottime_top"]))
    close_engine(engine)
    path = write_result(f"step-profile-{args.size}", {"benchmark": "step_profile", "size": args.size,
                                                     "slots": args.slots, "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
