"""Where a mixed step's host time goes (CUDA): 32 decode rows at context 512 plus prefill chunks, on
Llama-3-8B shapes with rank-16 adapters, run by the model runner as the engine runs it: eagerly, or with
--max-graph-tokens as a graph replay where the step's tokens fit a bucket. Prints the step's wall time
against its GPU time, then a cProfile table of the host side.

    python -m bench.engine.mixed_step --prefill 4x512
    python -m bench.engine.mixed_step --prefill 1x64 --max-graph-tokens 512
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from app.engine.scheduler import Chunk, StepPlan
from app.model.kernels import lora as lora_kernels
from bench.common import timed_ms
from bench.engine.decode import Seq, build, profile_table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--prefill", default="4x512", help="prompts x tokens")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--distinct", type=int, nargs="+", default=[8],
                        help="adapters the rows cycle through (0: the base model); several: one step each, in turn")
    parser.add_argument("--slots", type=int, default=64, help="the adapter pool's slots (the throughput runs': 32)")
    parser.add_argument("--rows", type=int, default=30, help="cProfile rows")
    parser.add_argument("--max-graph-tokens", type=int, default=0, help="replay steps of up to this many tokens "
                        "in graphs (the engine's default is 512; 0: eager)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--decode-t-max", type=int, default=lora_kernels.DECODE_T_MAX,
                        help="eager steps of up to this many tokens run the LoRA kernels' decode config")
    parser.add_argument("--kernels", action="store_true", help="also a torch.profiler table of the step's kernels")
    parser.add_argument("--m-programs", nargs="+", default=[",".join(map(str, lora_kernels.PREFILL_M_PROGRAMS))],
                        help="the LoRA kernels' choices of programs along M in eager steps (`prefill_m_programs`), "
                             "one run of every --distinct per comma-separated set: 4,8,16 4")
    args = parser.parse_args()
    n_prompts, prompt_len = map(int, args.prefill.split("x"))
    lora_kernels.DECODE_T_MAX = args.decode_t_max
    # max_batch_size counts every running request, the prefilling ones too (as in the engine)
    ns = argparse.Namespace(shape="llama-3-8b", quantization=None, layers=32, rank=16, slots=args.slots,
                            batches=[args.decode + n_prompts], prefill_tokens=n_prompts * prompt_len,
                            context=args.context, compile=args.compile,
                            max_graph_tokens=args.max_graph_tokens)
    model, lora, blocks, runner, *_ = build(ns, torch.device("cuda"))
    decode = [Seq(f"d{i}", [1] * args.context, None) for i in range(args.decode)]
    for s in decode:
        blocks.allocate(s.request_id, args.context + 1)
        s.num_cached, s.output_ids = args.context, [1]
    prompts = [Seq(f"p{i}", list(range(100, 100 + prompt_len)), None) for i in range(n_prompts)]
    for s in prompts:
        blocks.allocate(s.request_id, prompt_len)
    plan = StepPlan(decode=[Chunk(s, args.context, 1) for s in decode],
                    prefill=[Chunk(s, 0, prompt_len) for s in prompts])
    for choices in args.m_programs:
        lora_kernels.PREFILL_M_PROGRAMS = tuple(int(m) for m in choices.split(","))
        for distinct in args.distinct:
            for i, s in enumerate(decode):
                s.slot = i % distinct if distinct else None
            for i, s in enumerate(prompts):
                s.slot = i % distinct if distinct else None
            measure(runner, plan, args, distinct)


def measure(runner, plan: StepPlan, args, distinct: int) -> None:
    def step():
        runner.execute(plan)
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    gpu = sorted(timed_ms(lambda: runner.execute(plan), 5))[2]
    start = time.perf_counter()
    for _ in range(5):
        step()
    wall = (time.perf_counter() - start) / 5 * 1e3
    launch = []
    for _ in range(5):
        t0 = time.perf_counter()
        runner.execute(plan)
        launch.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    replays = runner.mixed_replays
    runner.execute(plan)
    torch.cuda.synchronize()
    mode = "graph" if runner.mixed_replays > replays else "eager"
    print(f"mixed step: {args.decode} decode rows + {args.prefill} prefill, {distinct} adapters, {mode}, programs "
          f"along M {lora_kernels.PREFILL_M_PROGRAMS}: wall "
          f"{wall:.1f} ms, GPU {gpu:.1f} ms, host launch {sorted(launch)[2]:.1f} ms", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.rows)
    print(text.getvalue())
    if args.kernels:
        profile_table(step, f"mixed step, {distinct} adapters", sort_by=("self_cuda_time_total",
                                                                         "self_cpu_time_total"))


if __name__ == "__main__":
    main()
