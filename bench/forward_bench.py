"""Decode-step time of the base model, the `fused` and the `peft` backends at 1, 8 and 32 distinct
adapters per batch, plus the host->device copy rate of the prefetch path against the pinned peak.

    python -m bench.forward_bench --size llama3-8b-shape --batch 32 --context 512   # GPU
    python -m bench.forward_bench --size small --batch 8 --context 128              # CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from app.demo import SIZES
from app.engine import ATTENTION_BACKENDS
from app.lora import FusedBackend, PeftBackend
from app.targets import SUPPORTED_TARGETS, target_shapes
from bench.common import write_result
from prefetch.copier import CudaCopier
from prefetch.host_cache import HostAdapter
from prefetch.layout import SlotLayout


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(size: str, device: torch.device, dtype: torch.dtype):
    """The demo size's shapes with seeded random weights, made on the device (no HF init on CPU)."""
    shape = SIZES[size]
    config = LlamaConfig(vocab_size=shape.vocab or 1024, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         rope_theta=shape.rope_theta, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=gen)
    with torch.device(device):  # to_empty left the rotary buffers uninitialized: rebuild them
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model, config


def fill_slots(backend, layout, num_slots, device, dtype):
    gen = torch.Generator(device=device).manual_seed(1)
    for slot in range(num_slots):
        flat = torch.randn(layout.numel, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
        backend.write_slot(slot, flat, torch.full((len(layout.modules),), 2.0))
    sync(device)


def time_decode(forward, model_config, batch, context, device, iters, warmup=5) -> float:
    """Median ms of one decode step at `context` cached tokens, re-using one prefilled cache."""
    vocab = model_config.vocab_size
    gen = torch.Generator(device=device).manual_seed(2)
    prompt = torch.randint(vocab, (batch, context), generator=gen, device=device)
    cache = DynamicCache(config=model_config)
    with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):  # the engine's attention kernels
        forward(slots=None, input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = torch.randint(vocab, (batch, 1), generator=gen, device=device)
        positions = torch.full((batch, 1), context, device=device)
        mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
        times = []
        for i in range(warmup + iters):
            sync(device)
            start = time.perf_counter()
            forward(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
            for layer in cache.layers:  # drop the appended column: every step sees `context` tokens
                layer.keys, layer.values = layer.keys[:, :, :context], layer.values[:, :, :context]
    return statistics.median(times[warmup:])


def bench_backend(kind, args, device, dtype):
    model, config = build(args.size, device, dtype)
    layout = SlotLayout(target_shapes(config), args.rank)
    num_slots = max(args.distinct)
    backend = FusedBackend(model, layout, num_slots) if kind == "fused" else PeftBackend(
        model, layout, num_slots, SUPPORTED_TARGETS)
    fill_slots(backend, layout, num_slots, device, dtype)
    rows: dict[str, list[float]] = {}
    # Two passes in alternating order; each config keeps its better median, so clock ramps and
    # one-off hiccups do not masquerade as differences between configs.
    for pass_index in range(2):
        configs = [0] + args.distinct
        for distinct in configs if pass_index == 0 else reversed(configs):
            slot_of_row = [None] * args.batch if distinct == 0 else [i % distinct for i in range(args.batch)]

            def forward(slots=slot_of_row, backend=backend, **inputs):
                return backend.forward(slots if slots is not None else [None] * inputs["input_ids"].shape[0],
                                       **inputs)

            iters = args.iters if kind == "fused" or distinct <= 1 else max(3, args.iters // 4)
            rows.setdefault(str(distinct), []).append(time_decode(forward, config, args.batch, args.context,
                                                                  device, iters))
    rows = {d: min(times) for d, times in rows.items()}
    for distinct, ms in rows.items():
        print(f"{kind:6s} distinct={int(distinct):3d}  {ms:9.2f} ms/step", flush=True)
    del backend, model
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows, layout


def copy_rates(layout, device, dtype, repeats=10) -> dict:
    """Pinned peak (a 256 MB pinned copy) and the prefetch path's H2D rate for one adapter."""
    peak_src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    peak_dst = torch.empty_like(peak_src, device=device)
    pageable = torch.empty(256 << 20, dtype=torch.uint8)
    rates = {}
    for name, src in (("pinned_peak", peak_src), ("pageable", pageable)):
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            peak_dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(src.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
        rates[f"{name}_gb_per_s"] = max(samples)  # the peak: the best of the repeats
        rates[f"{name}_median_gb_per_s"] = statistics.median(samples)
    flat = torch.randn(layout.numel, dtype=torch.float32).to(dtype).pin_memory()
    host = HostAdapter("bench", flat, torch.ones(len(layout.modules)).pin_memory(), 0.0)
    sink = [torch.empty(0)]
    copier = CudaCopier(device, lambda slot, staging, scales: sink.__setitem__(0, staging), num_slots=1)
    samples, issue_ms = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        transfer = copier.start(0, host)
        issue_ms.append((time.perf_counter() - t0) * 1e3)
        transfer.wait()
        samples.append(transfer.nbytes / transfer.h2d_seconds() / 1e9)
    rates["adapter_bytes"] = host.nbytes
    rates["prefetch_h2d_gb_per_s"] = statistics.median(samples)
    rates["prefetch_fraction_of_peak"] = rates["prefetch_h2d_gb_per_s"] / rates["pinned_peak_gb_per_s"]
    rates["host_issue_ms"] = statistics.median(issue_ms)
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--distinct", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--backends", nargs="+", default=["fused", "peft"], choices=["fused", "peft"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results, layout = {}, None
    for kind in args.backends:
        results[kind], layout = bench_backend(kind, args, device, dtype)
    base = results[args.backends[0]]["0"]
    summary = {k: {d: ms / base for d, ms in rows.items()} for k, rows in results.items()}
    payload = {"size": args.size, "batch": args.batch, "context": args.context, "rank": args.rank,
               "dtype": str(dtype), "decode_step_ms": results, "relative_to_base": summary}
    if "fused" in results and "peft" in results:
        payload["peft_over_fused"] = {d: results["peft"][d] / results["fused"][d] for d in results["fused"]}
    if device.type == "cuda":
        payload["copy"] = copy_rates(layout, device, dtype)
        print(payload["copy"])
    print("wrote", write_result(f"forward-{args.size}", payload))


if __name__ == "__main__":
    main()
