"""The segmented LoRA kernels at Llama-3-8B shapes: 32 layers x 7 targets of shrink+expand in one CUDA graph.

    python -m bench.kernel.lora --out-dir bench/results [--sweep]     # CUDA only

Prints one JSON line per case. Decode: floor_ms = bytes of the D active adapters' A and B over the HBM
read rate measured in the same run (a read-only sum over a 4 GiB bf16 buffer). Prefill: floor_ms also
counts reading x and reading+writing y once per target; adapter_floor_ms is the adapter part alone.
`distinct = 0` (every segment -1) times the graph's launches alone, the floor of any two-kernel design.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from app.model.kernels.lora import DECODE, PREFILL, KernelConfig, LoRAWorkspace, lora_apply
from bench.common import RESULTS, timed_ms

TARGETS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
           "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}  # (in, out)
LAYERS, RANK, SLOTS = 32, 16, 64
PAGE_ROWS = 4  # the engine's default adapter_page_rows
DTYPE = torch.bfloat16

KC = KernelConfig
SWEEP_DECODE = [KC(8, 16, 256, 4, num_stages=3), KC(8, 16, 512, 4), KC(4, 16, 256, 4), KC(8, 16, 128, 4),
                KC(16, 16, 256, 4)]
SWEEP_PREFILL = [KC(8, 64, 128, 4, 2, m_programs=1), KC(8, 64, 128, 4, 2, m_programs=8), KC(8, 64, 256, 4, 2, 4),
                 KC(16, 64, 128, 4, 2, 4), KC(8, 32, 128, 4, 2, 4), KC(8, 64, 128, 4, 1, 4)]


def hbm_read_rate(iters: int = 10) -> float:
    """Bytes/s of a read-only pass (sum) over 4 GiB."""
    buf = torch.empty(2 * 1024**3, dtype=DTYPE, device="cuda").normal_()
    ms = median_ms(lambda: buf.sum(), iters)
    del buf
    torch.cuda.empty_cache()
    return 4 * 1024**3 / (ms * 1e-3)


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    return statistics.median(timed_ms(fn, iters, warmup))


def adapter_bytes(distinct: int) -> int:
    return distinct * LAYERS * sum(RANK * (k + n) * 2 for k, n in TARGETS.values())


def activation_bytes(tokens: int) -> int:
    return LAYERS * sum(tokens * (k + 2 * n) * 2 for k, n in TARGETS.values())  # read x, read+write y


class Stack:
    """Static inputs of one token bucket and the graph of all 224 shrink+expand pairs over them."""

    def __init__(self, weights, t_cap: int, s_cap: int):
        self.weights, self.t_cap, self.s_cap = weights, t_cap, s_cap
        self.scales = torch.full((SLOTS,), 2.0, device="cuda")
        self.ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
        # Each slot's weights as pages of PAGE_ROWS rank rows, slot s in pages s * RANK / PAGE_ROWS onwards.
        self.page_table = torch.arange(SLOTS * RANK // PAGE_ROWS, dtype=torch.int32, device="cuda").view(SLOTS, -1)
        self.token_order = torch.zeros(t_cap, dtype=torch.int32, device="cuda")
        self.seg_starts = torch.zeros(s_cap + 1, dtype=torch.int32, device="cuda")
        self.seg_slots = torch.full((s_cap,), -1, dtype=torch.int32, device="cuda")
        self.xs = {k: torch.randn(t_cap, k, dtype=DTYPE, device="cuda") for k in {4096, 14336}}
        self.ys = {name: torch.randn(t_cap, n, dtype=DTYPE, device="cuda") for name, (_, n) in TARGETS.items()}
        self.ws = LoRAWorkspace.allocate(t_cap, RANK, [k for k, _ in TARGETS.values()], "cuda",
                                         configs=(DECODE, PREFILL, *SWEEP_DECODE, *SWEEP_PREFILL))
        self.graph = None

    def set_segments(self, segments: list[tuple[int, int]]) -> None:
        """segments: [(n_tokens, slot)]; written in place, so a captured graph follows them."""
        real = sum(n for n, _ in segments)
        order = torch.zeros(self.t_cap, dtype=torch.int32)
        order[:real] = torch.randperm(real, dtype=torch.int32)
        starts, slots = [0], []
        for n, slot in segments:
            starts.append(starts[-1] + n)
            slots.append(slot)
        starts += [real] * (self.s_cap - len(segments))
        slots += [-1] * (self.s_cap - len(segments))
        self.token_order.copy_(order)
        self.seg_starts.copy_(torch.tensor(starts, dtype=torch.int32))
        self.seg_slots.copy_(torch.tensor(slots, dtype=torch.int32))

    def step(self, config: KernelConfig) -> None:
        meta = (self.token_order, self.seg_starts, self.seg_slots)
        for layer in self.weights:
            for name, (A, BT) in layer.items():
                lora_apply(self.ys[name], self.xs[A.shape[2]], A.view(-1, PAGE_ROWS, A.shape[2]),
                           BT.view(-1, PAGE_ROWS, BT.shape[2]), self.scales, self.ranks, self.page_table, *meta,
                           self.ws, config)

    def capture(self, config: KernelConfig) -> None:
        self.graph = None
        self.step(config)  # compiles every kernel variant before capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step(config)

    def time(self, iters: int) -> float:
        return median_ms(self.graph.replay, iters)


def decode_segments(tokens: int, distinct: int) -> list[tuple[int, int]]:
    if distinct == 0:
        return [(tokens, -1)]
    slots = torch.randperm(SLOTS)[:distinct].tolist()
    return [(tokens // distinct + (i < tokens % distinct), slot) for i, slot in enumerate(slots)]


def run_cases(weights, rate: float, sweep: bool, emit) -> None:
    for tokens, cases in [(32, [0, 1, 8, 32]), (64, [64])]:
        stack = Stack(weights, t_cap=tokens, s_cap=tokens)
        for config in [DECODE] + (SWEEP_DECODE if sweep else []):
            stack.capture(config)
            for distinct in (cases if config is DECODE else [1, cases[-1]]):
                stack.set_segments(decode_segments(tokens, distinct))
                ms = stack.time(iters=30)
                floor = adapter_bytes(distinct) / rate * 1e3
                emit(dict(case="decode", tokens=tokens, distinct=distinct, ms=ms, floor_ms=floor,
                          ratio_to_floor=ms / floor if distinct else None, default=config is DECODE,
                          config=asdict(config)))
        del stack
    stack = Stack(weights, t_cap=4096, s_cap=16)
    for config in [PREFILL] + (SWEEP_PREFILL if sweep else []):
        stack.capture(config)
        for distinct in ([0, 8] if config is PREFILL else [8]):
            stack.set_segments(decode_segments(4096, distinct))
            ms = stack.time(iters=10)
            adapters = adapter_bytes(distinct) / rate * 1e3
            floor = adapters + activation_bytes(4096 if distinct else 0) / rate * 1e3
            emit(dict(case="prefill", tokens=4096, segments=distinct, distinct=distinct, ms=ms, floor_ms=floor,
                      adapter_floor_ms=adapters, ratio_to_floor=ms / floor if distinct else None,
                      default=config is PREFILL, config=asdict(config)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.kernel.lora needs CUDA")
    torch.manual_seed(0)
    rate = hbm_read_rate()
    lines = [dict(case="hbm_read", gbps=rate / 1e9)]
    print(json.dumps(lines[0]), flush=True)
    weights = [{name: (torch.randn(SLOTS, RANK, k, dtype=DTYPE, device="cuda").mul_(0.02),
                       torch.randn(SLOTS, RANK, n, dtype=DTYPE, device="cuda").mul_(0.02))
                for name, (k, n) in TARGETS.items()} for _ in range(LAYERS)]

    name = torch.cuda.get_device_name()
    slug = next((f"{key}-x{torch.cuda.device_count()}" for key in ("h200", "h100") if key in name.lower()), "gpu")
    record = dict(command=" ".join(sys.orig_argv), git_commit=os.environ.get("LORA_GIT_COMMIT", "unknown"),
                  device=name, torch=torch.__version__, timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  lines=lines)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def emit(line):  # rewrites the file each time, so a run cut short keeps what it measured
        lines.append(line)
        print(json.dumps(line), flush=True)
        (args.out_dir / f"{slug}-lora-kernels.json").write_text(json.dumps(record, indent=2) + "\n")

    run_cases(weights, rate, args.sweep, emit)


if __name__ == "__main__":
    main()
