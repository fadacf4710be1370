"""The base model's GEMMs in FP8 against bf16, at Llama-3-8B shapes: 32 layers of the four linear groups the engine
runs (q/k/v fused, o, gate/up fused, down) in one CUDA graph, per batch of M tokens.

    python -m bench.kernel.fp8 [--out-dir bench/results]     # CUDA with FP8 tensor cores only

Variants per M: `bf16` (F.linear); `fp8` (app.model.fp8.fp8_linear as the engine runs it: the fused per-token
quantization, then up to SMALL_BATCH_ROWS tokens the tensor-wise GEMM into float32 and the fused rescale, above
them torch._scaled_mm with row-wise scales); `fp8_rowwise` (the fused quantization and the row-wise GEMM at every
M); `fp8_torch_quantization` (the row-wise GEMM after quantize_rows' seven plain torch kernels); the GEMMs alone on
quantized operands: `gemm_rowwise`, `gemm_tensorwise` (bf16 out), `gemm_tensorwise_float32`; `quantization` (the
fused quantization alone).
floor_ms: the weights' bytes (bf16, or FP8 plus its scales) over the HBM read rate measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from app.model.fp8 import Fp8Weight, fp8_linear, quantize_rows
from app.model.kernels.fp8 import quantize_rows_fused
from bench.common import RESULTS, write_result
from bench.kernel.lora import hbm_read_rate, median_ms

GROUPS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (in, out)
LAYERS = 32
TOKENS = [1, 16, 32, 64, 128, 256, 512, 2048]


def rowwise_linear(x, weight: Fp8Weight, quantize=quantize_rows_fused):
    q, scale = quantize(x)
    return torch._scaled_mm(q, weight.q.t(), scale_a=scale, scale_b=weight.scale[None, :], out_dtype=x.dtype)


def graph_ms(step, iters: int = 20) -> float:
    step()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = median_ms(graph.replay, iters)
    del graph
    return ms


def run(rate: float) -> list[dict]:
    bf16 = [{name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda").mul_(0.02)
             for name, (k, n) in GROUPS.items()} for _ in range(LAYERS)]
    fp8 = [{name: Fp8Weight.quantize(w) for name, w in layer.items()} for layer in bf16]
    bf16_bytes = sum(w.numel() * 2 for layer in bf16 for w in layer.values())
    fp8_bytes = sum(w.nbytes() for layer in fp8 for w in layer.values())
    one = torch.ones((), dtype=torch.float32, device="cuda")
    lines = []
    for m in TOKENS:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for k in {k for k, _ in GROUPS.values()}}
        quantized = {k: quantize_rows_fused(x) for k, x in xs.items()}

        def each(fn):
            return lambda: [fn(name, k, layer) for layer in range(LAYERS) for name, (k, _) in GROUPS.items()]

        def gemm(name, k, layer, scale_a=None, scale_b=None, out_dtype=torch.bfloat16):
            weight = fp8[layer][name]
            return torch._scaled_mm(quantized[k][0], weight.q.t(), out_dtype=out_dtype,
                                    scale_a=quantized[k][1] if scale_a is None else scale_a,
                                    scale_b=weight.scale[None, :] if scale_b is None else scale_b)

        variants = {
            "bf16": each(lambda name, k, layer: F.linear(xs[k], bf16[layer][name])),
            "fp8": each(lambda name, k, layer: fp8_linear(xs[k], fp8[layer][name])),
            "fp8_rowwise": each(lambda name, k, layer: rowwise_linear(xs[k], fp8[layer][name])),
            "fp8_torch_quantization": each(lambda name, k, layer: rowwise_linear(xs[k], fp8[layer][name],
                                                                                 quantize_rows)),
            "gemm_rowwise": each(gemm),
            "gemm_tensorwise": each(lambda name, k, layer: gemm(name, k, layer, one, one)),
            "gemm_tensorwise_float32": each(lambda name, k, layer: gemm(name, k, layer, one, one, torch.float32)),
            "quantization": each(lambda name, k, layer: quantize_rows_fused(xs[k])),
        }
        line = dict(tokens=m, floor_ms={"bf16": bf16_bytes / rate * 1e3, "fp8": fp8_bytes / rate * 1e3})
        for variant, step in variants.items():
            line[variant + "_ms"] = graph_ms(step)
        line["fp8_over_bf16"] = line["fp8_ms"] / line["bf16_ms"]
        line["bf16_over_floor"] = line["bf16_ms"] / line["floor_ms"]["bf16"]
        line["fp8_over_floor"] = line["fp8_ms"] / line["floor_ms"]["fp8"]
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("bench.kernel.fp8 needs a GPU with FP8 tensor cores")
    torch.manual_seed(0)
    started = time.perf_counter()
    rate = hbm_read_rate()
    print(f"HBM read rate {rate / 1e9:.0f} GB/s", flush=True)
    lines = run(rate)
    path = write_result("fp8-gemm", dict(hbm_read_gbps=rate / 1e9, layers=LAYERS, groups=GROUPS, lines=lines,
                                         seconds=time.perf_counter() - started), args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
