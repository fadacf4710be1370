"""Paged GQA decode attention (Triton) at Llama-3-8B shapes, 32 layers in one CUDA graph, against the HBM floor.

floor = KV bytes read (B x L x 2 x Hkv x D x 2 bytes x layers) / the HBM read rate measured in the same run (a
read-only .sum() of a 4 GiB bf16 buffer). SDPA with enable_gqa on contiguous K/V is timed the same way.

    python -m bench.kernel.attention                 # CUDA only; prints one JSON line per case
    python -m bench.kernel.attention --sweep         # also split counts and tile configs per case
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from app.model.kernels.attention import decode_workspace, paged_decode_attention
from bench.common import RESULTS, write_result

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 8, 128, 16
DTYPE = torch.bfloat16
CASES = [(1, 512), (8, 512), (32, 512), (64, 512), (32, 2048), (1, 8192)]  # (batch, context)
CONFIGS = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 2)]  # (block_n, num_warps, num_stages)


def time_graph(step, replays: int = 20, repeats: int = 5) -> float:
    """Median ms of one replay of a graph holding `step` (already run once, so Triton compiled outside capture)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(samples)


def hbm_read_gbps() -> float:
    buf = torch.ones(2**31, dtype=DTYPE, device="cuda")  # 4 GiB, far past L2
    buf.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(10):
        start.record()
        buf.sum()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return buf.numel() * buf.element_size() / statistics.median(samples) / 1e6


def paged_layers(batch: int, context: int):
    """Per-layer caches with every row's blocks shuffled over the pool, as a running engine leaves them."""
    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = 1 + batch * blocks_per_row
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, dtype=DTYPE, device="cuda"), torch.randn(shape, dtype=DTYPE, device="cuda"))
              for _ in range(LAYERS)]
    tables = (1 + torch.randperm(num_blocks - 1, device="cuda")).view(batch, blocks_per_row).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return caches, tables, lens


def bench_paged(batch, context, caches, tables, lens, num_splits=None, config=(None, 4, 2)) -> tuple[float, int]:
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    workspace = decode_workspace(q, KV_HEADS, tables, BLOCK_SIZE, num_splits=num_splits)
    block_n, num_warps, num_stages = config

    def step():
        for k, v in caches:
            paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5, out=out, workspace=workspace,
                                   block_n=block_n, num_warps=num_warps, num_stages=num_stages)

    return time_graph(step), workspace.num_splits


def bench_sdpa(batch, context) -> float:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
    kv = [(torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device="cuda"),
           torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=DTYPE, device="cuda")) for _ in range(LAYERS)]

    def step():
        for k, v in kv:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return time_graph(step)


def record(lines, kernel, batch, context, ms, floor_ms, **extra):
    line = {"kernel": kernel, "batch": batch, "context": context, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
            "ratio_to_floor": round(ms / floor_ms, 2), **extra}
    print(json.dumps(line), flush=True)
    lines.append(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time split counts and tile configs")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernel.attention needs CUDA")
    gbps = hbm_read_gbps()
    print(json.dumps({"hbm_read_gbps": round(gbps, 1)}), flush=True)
    lines = []
    for batch, context in CASES:
        floor_ms = batch * context * 2 * KV_HEADS * HEAD_DIM * 2 * LAYERS / gbps / 1e6
        caches, tables, lens = paged_layers(batch, context)
        ms, splits = bench_paged(batch, context, caches, tables, lens)
        record(lines, "triton_paged", batch, context, ms, floor_ms, num_splits=splits)
        if args.sweep:
            for num_splits in sorted({1, 2, 4, 8, 16, 32, 64} - {splits}):
                if num_splits * 64 <= context:
                    ms, _ = bench_paged(batch, context, caches, tables, lens, num_splits=num_splits)
                    record(lines, "sweep_splits", batch, context, ms, floor_ms, num_splits=num_splits)
            for config in CONFIGS:
                ms, _ = bench_paged(batch, context, caches, tables, lens, config=config)
                record(lines, "sweep_config", batch, context, ms, floor_ms, num_splits=splits,
                       block_n=config[0], num_warps=config[1], num_stages=config[2])
        del caches, tables, lens
        torch.cuda.empty_cache()
        record(lines, "sdpa_gqa_contiguous", batch, context, bench_sdpa(batch, context), floor_ms)
        torch.cuda.empty_cache()
    path = write_result("attention-kernels", {"hbm_read_gbps": round(gbps, 1), "layers": LAYERS,
                                              "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                              "block_size": BLOCK_SIZE, "cases": lines}, out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
