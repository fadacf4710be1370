"""The engine core's decode step and prefill against the hardware floor, measured in the same run (CUDA).

A published model's shapes (`--shape`: Llama-3-8B by default, Qwen2.5-7B, Gemma-2-9B), its config built by
transformers' own config class and the model by transformers' own code, random bf16 weights built on the GPU,
rank-16 adapters on all seven targets in `--slots` slots. The model runner (paged KV cache, GQA paged attention,
segmented LoRA, one CUDA graph per batch bucket) runs:
- decode steps at each batch size, context `--context`, base rows and rows over D distinct adapters:
  the graph replay alone (GPU time, CUDA events), and a whole `execute()` (host input preparation +
  copies + replay) timed on the host; `--runs` repetitions give the run-to-run spread;
- the same decode step eagerly (no graph) at one batch size, for comparison;
- a prefill of 8 prompts x 512 tokens in one step, as achieved TFLOP/s against a bf16 GEMM.
Floors: the model's weight bytes (every parameter once; a tied embedding counts once) / HBM read rate (a
read-only sum over 8 GiB); LoRA: bytes of the distinct adapters read once / the same rate; K/V: the cache bytes
the step's attention reads (each layer's window applied) / the same rate, beside the step and beside its
attention alone (every layer's decode kernel in one graph). Prints one JSON line per measurement; --out writes
them all. --dry-run builds the shape on the meta device (no GPU) and prints its bytes. `--quantization fp8`: the
projections in FP8 as the engine's `quantization: fp8` loads them; the floor is then the FP8 model's bytes,
`bf16_floor_ms` the same model's in bf16, and prefill is measured against an FP8 GEMM (torch._scaled_mm) too.
`--attention-splits 1 2 4 8` times the attention alone at each split-K count beside the engine's own choice.

    python -m bench.engine.decode --batches 1 8 32 64 --context 512 --out bench/results/h100-x1-decode.json
    python -m bench.engine.decode --shape gemma-2-9b --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from app.model.architectures import check_supported, head_dim
from app.model.attention import PagedKVCache
from app.model.fp8 import quantize_linears
from app.model.kernels import attention as attention_kernels
from app.model.kernels import lora as lora_kernels
from app.engine.kv_blocks import BlockManager
from app.model.lora import LoRASlots
from app.engine.model_runner import ModelRunner
from app.engine.scheduler import Chunk, StepPlan
from app.adapters.targets import target_shapes
from bench.common import timed_ms
from prefetch.layout import PageLayout

# name -> (config class, model class, the published model's config.json fields that shape its decode step)
SHAPES = {
    "llama-3-8b": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama-3-70b": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)),
    # Qwen2's attention always has q/k/v biases; its window is off (use_sliding_window false)
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, tie_word_embeddings=False)),
    # head_dim 256; every other layer (sliding_attention) attends within 4096 tokens; norms x * (1 + w)
    "gemma-2-9b": (Gemma2Config, Gemma2ForCausalLM, dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096, tie_word_embeddings=True)),
}


def shape_config(shape: str, layers: int | None = None):
    config_class, _, fields = SHAPES[shape]
    return config_class(**{**fields, "num_hidden_layers": layers or fields["num_hidden_layers"]})


def kv_read_bytes(config, batch: int, length: int) -> int:
    """K/V bytes (bf16) the decode attention reads for `batch` rows that each attend `length` cached tokens."""
    per_token = 2 * config.num_key_value_heads * head_dim(config) * 2
    windows = check_supported(config).windows(config)
    return sum(batch * min(length, window or length) * per_token for window in windows)


def describe(config, model, args) -> dict:
    """What the result records of the shape: its dimensions and what its attention computes."""
    arch = check_supported(config)
    windows = [w for w in arch.windows(config) if w is not None]
    embedding = model.get_input_embeddings().weight
    return dict(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                kv_heads=config.num_key_value_heads, head_dim=head_dim(config), vocab=config.vocab_size,
                tied_embeddings=sum(p is embedding for _, p in model.named_parameters(remove_duplicate=False)) > 1,
                windowed_layers=len(windows), window=max(windows, default=None),
                window_passed=any(args.context + 1 > w for w in windows),  # at --context, the new token included
                attn_softcap=arch.attention_softcap(config), final_softcap=arch.logit_softcap(config))


def weight_bytes(model) -> int:
    """Every parameter once (parameters() yields a tied one once), and the FP8 weights and scales of Fp8Linear."""
    fp8 = [b for name, b in model.named_buffers() if name.endswith((".weight_q", ".weight_scale"))]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *fp8])


def bf16_gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n ** 3 / (statistics.median(cuda_ms(lambda: a @ a, 10)) / 1e3) / 1e12


def fp8_gemm_tflops(n: int = 8192) -> float:
    """An FP8 n³ GEMM with row-wise scales, as the FP8 projections run at prefill sizes."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    gemm = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    return 2 * n ** 3 / (statistics.median(cuda_ms(gemm, 10)) / 1e3) / 1e12


def build_model(args, dev):
    config = shape_config(args.shape, args.layers)
    _, model_class, _ = SHAPES[args.shape]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = model_class(config).eval()
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return config, model


@dataclass(eq=False)
class Seq:
    request_id: str
    prompt_ids: list[int]
    slot: int | None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    pending_row: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]


def cuda_ms(fn, iters: int) -> list[float]:
    return timed_ms(fn, iters)


def host_ms(fn, iters: int) -> list[float]:
    return timed_ms(fn, iters, host=True)


def profile_table(fn, title: str, steps: int = 3, sort_by: tuple[str, ...] = ("self_cuda_time_total",)) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    for key in sort_by:
        print(f"== profile: {title} ({steps} steps), by {key} ==")
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


def build(args, dev):
    config, model = build_model(args, dev)
    bf16_bytes = weight_bytes(model)
    if args.quantization == "fp8":
        quantize_linears(model, target_shapes(config))
    layout = PageLayout(target_shapes(config), max_rank=args.rank)
    max_batch = max(args.batches)
    lora = LoRASlots(model, layout, args.slots * layout.max_pages, args.slots,  # t_cap: the eager warm-up's step too
                      t_cap=max(args.prefill_tokens + max_batch, lora_kernels.DECODE_T_MAX + 8 + max_batch,
                                getattr(args, "max_graph_tokens", 0)))
    gen = torch.Generator(device=dev).manual_seed(1)
    for slot in range(args.slots):
        pages = range(slot * layout.max_pages, (slot + 1) * layout.max_pages)
        host = [torch.randn(layout.page_numel, generator=gen, device=dev).mul_(0.01).to(torch.bfloat16) for _ in pages]
        lora.write_slot(slot, list(pages), host, torch.full((len(layout.modules),), 2.0), args.rank)
    adapter_bytes = layout.adapter_nbytes(args.rank, torch.bfloat16)
    per_seq = -(-(max(args.context, 512) + 2) // 16)
    blocks = BlockManager(2 + per_seq * (max_batch + 8), 16)
    cache = PagedKVCache.for_model(config, blocks.num_blocks, 16, torch.bfloat16, dev)
    t0 = time.perf_counter()
    runner = ModelRunner(model, lora, blocks, cache, max_batch, config.max_position_embeddings, use_graphs=True,
                         compile_decode=args.compile, max_graph_tokens=getattr(args, "max_graph_tokens", 0))
    capture_s = time.perf_counter() - t0
    if runner.cuda_graphs is None:  # the figures would be of eager reference attention, not the engine's decode
        raise SystemExit(f"{args.shape}: decode runs without CUDA graphs (Triton decode attention takes head_dim "
                         f"{attention_kernels.HEAD_DIMS}, this model has {runner.head_dim})")
    return model, lora, blocks, runner, weight_bytes(model), bf16_bytes, adapter_bytes, capture_s


def attention_alone(runner, bucket: int, iters: int, num_splits: int | None = None) -> tuple[float, float]:
    """GPU ms of the decode step's attention alone: every layer's kernel (its window and cap) in one CUDA graph,
    over the bucket's static block tables and lengths as the last replayed step left them; and the last layer's
    largest error against the fp32 reference, relative to its largest output. num_splits: the split-K count
    (default: the engine's heuristic, `num_kv_splits`)."""
    config, graphs, cache = runner.model.config, runner.cuda_graphs, runner.cache
    q = torch.randn(bucket, config.num_attention_heads, runner.head_dim, dtype=cache.k.dtype, device=cache.k.device)
    out = torch.empty_like(q)
    tables, lens = graphs.static_tables[:bucket], graphs.static_lens[:bucket]
    workspace = attention_kernels.decode_workspace(q, config.num_key_value_heads, tables, runner.block_size,
                                                   num_splits)
    cap, scale = runner.arch.attention_softcap(config), runner.model.model.layers[0].self_attn.scaling

    def step():
        for layer, window in enumerate(runner.arch.windows(config)):
            attention_kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, lens, scale, out=out,
                                                     workspace=workspace, window=window, softcap=cap)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = statistics.median(cuda_ms(graph.replay, iters))
    layer, window = config.num_hidden_layers - 1, runner.arch.windows(config)[-1]
    expected = attention_kernels.paged_decode_reference(q.float(), cache.k[layer].float(), cache.v[layer].float(),
                                                        tables, lens, scale, window, cap)
    error = (out.float() - expected).abs().max().item() / expected.abs().max().item()
    return ms, error


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3-8b", help="the published model's shapes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5, help="repetitions of each decode measurement (spread)")
    parser.add_argument("--eager-batch", type=int, default=32)
    parser.add_argument("--profile-batch", type=int, default=32, help="the decode batch that PROFILE tables")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--skip-decode", action="store_true", help="prefill (and eager) only")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decoder before capture")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="the projections' weights in FP8")
    parser.add_argument("--attention-splits", type=int, nargs="*", default=[],
                        help="also time the base step's attention alone at each of these split-K counts")
    parser.add_argument("--lora-block-m", type=int, help="tokens per tile of the LoRA kernels' decode config")
    parser.add_argument("--dry-run", action="store_true", help="build on the meta device, print the bytes, exit")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = []
    if args.lora_block_m:
        lora_kernels.DECODE = replace(lora_kernels.DECODE, block_m=args.lora_block_m)

    def emit(**kw):
        print(json.dumps(kw), flush=True)
        lines.append(kw)

    if args.dry_run:
        config, model = build_model(args, torch.device("meta"))
        kv_gb = {batch: round(kv_read_bytes(config, batch, args.context + 1) / 1e9, 3) for batch in args.batches}
        emit(variant="shape", shape=args.shape, weights_gb=round(weight_bytes(model) / 1e9, 2),
             **describe(config, model, args), kv_read_gb=kv_gb)
        return lines
    dev = torch.device("cuda")

    buf = torch.empty(4 << 30, dtype=torch.bfloat16, device=dev).normal_()
    read_gbs = buf.numel() * 2 / (statistics.median(cuda_ms(buf.sum, 10)) / 1e3) / 1e9
    del buf
    gemm_tflops = bf16_gemm_tflops()
    fp8_tflops = fp8_gemm_tflops() if args.quantization == "fp8" else None
    torch.cuda.empty_cache()

    model, lora, blocks, runner, nbytes, bf16_bytes, adapter_bytes, capture_s = build(args, dev)
    config = model.config
    floor_ms = nbytes / read_gbs / 1e6
    bf16_floor_ms = bf16_bytes / read_gbs / 1e6
    emit(variant="floor", shape=args.shape, quantization=args.quantization, weights_gb=round(nbytes / 1e9, 2),
         hbm_read_gbs=round(read_gbs), floor_ms=round(floor_ms, 3), bf16_floor_ms=round(bf16_floor_ms, 3),
         gemm_tflops=round(gemm_tflops), fp8_gemm_tflops=fp8_tflops and round(fp8_tflops),
         adapter_mb=round(adapter_bytes / 1e6, 1),
         graph_capture_s=round(capture_s, 1), buckets=runner.graph_batches, compiled=runner.compiled,
         lora_decode_block_m=lora_kernels.DECODE.block_m, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
         **describe(config, model, args))

    # Prefill: 8 prompts x 512 tokens, one step, 8 distinct adapters
    n_prompts = args.prefill_tokens // 512
    linear_params = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2) + sum(
        b.numel() for name, b in model.model.layers.named_buffers() if name.endswith(".weight_q"))  # FP8 weights
    for distinct in (0, n_prompts):
        seqs = [Seq(f"p{distinct}-{i}", torch.randint(0, 128000, (512,)).tolist(), i % distinct if distinct else None)
                for i in range(n_prompts)]
        for s in seqs:
            blocks.allocate(s.request_id, 512)
        plan = StepPlan(prefill=[Chunk(s, 0, 512) for s in seqs])
        times = cuda_ms(lambda: runner.execute(plan), 5)
        if os.environ.get("PROFILE"):
            profile_table(lambda: runner.execute(plan), f"prefill, {distinct} distinct adapters")
        attention_flops = 4 * config.num_attention_heads * runner.head_dim * n_prompts * 512 * 512 / 2
        flops = 2 * linear_params * args.prefill_tokens + attention_flops * config.num_hidden_layers
        ms = statistics.median(times)
        fp8_ratio = {} if fp8_tflops is None else dict(ratio_to_fp8_gemm=round(flops / ms / 1e9 / fp8_tflops, 3))
        emit(variant="prefill", prompts=n_prompts, tokens=args.prefill_tokens, distinct=distinct, ms=round(ms, 2),
             tflops=round(flops / ms / 1e9, 1), ratio_to_gemm=round(flops / ms / 1e9 / gemm_tflops, 3), **fp8_ratio)
        for s in seqs:
            blocks.release(s.request_id)

    # Decode at each batch size
    for batch in [] if args.skip_decode else args.batches:
        for distinct in sorted({0, min(batch, args.slots)} | ({1} if batch > 1 else set())):
            seqs = [Seq(f"d{batch}-{distinct}-{i}", torch.randint(0, 128000, (args.context,)).tolist(),
                        i % distinct if distinct else None) for i in range(batch)]
            for s in seqs:  # prefill in groups, then one sampled token each: decode feeds position `context`
                blocks.allocate(s.request_id, args.context + 1)
            for i in range(0, batch, 8):
                group = seqs[i:i + 8]
                runner.execute(StepPlan(prefill=[Chunk(s, 0, args.context) for s in group]))
            for s in seqs:
                s.num_cached, s.output_ids = args.context, [1]
            plan = StepPlan(decode=[Chunk(s, args.context, 1) for s in seqs])
            graph = runner.cuda_graphs.graph_for(runner.prepare(plan))
            runner.execute(plan)
            replay = [statistics.median(cuda_ms(graph.graph.replay, args.iters)) for _ in range(args.runs)]
            whole = [statistics.median(host_ms(lambda: runner.execute(plan), args.iters)) for _ in range(args.runs)]
            host = statistics.median(host_ms(lambda: runner.cuda_graphs.fill(runner.prepare(plan), graph.batch), args.iters))
            if os.environ.get("PROFILE") and batch == args.profile_batch:
                profile_table(graph.graph.replay, f"decode graph replay, batch {batch}, {distinct} distinct adapters")
            ms = statistics.median(replay)
            lora_floor = distinct * adapter_bytes / read_gbs / 1e6
            kv_bytes = kv_read_bytes(config, batch, args.context + 1)
            kv_floor = kv_bytes / read_gbs / 1e6
            attention = {}
            if distinct == 0:
                attention_ms, attention_error = attention_alone(runner, graph.batch, args.iters)
                attention = dict(attention_ms=round(attention_ms, 3),
                                 attention_ratio_to_kv_floor=round(attention_ms / kv_floor, 3),
                                 attention_error=float(f"{attention_error:.2g}"),
                                 attention_splits=graph.attention_workspace.num_splits)
                if args.attention_splits:
                    attention["attention_ms_by_splits"] = {
                        n: round(attention_alone(runner, graph.batch, args.iters, n)[0], 3)
                        for n in args.attention_splits}
            emit(variant="decode", shape=args.shape, batch=batch, bucket=graph.batch, context=args.context,
                 distinct=distinct, ms=round(ms, 3), ratio_to_floor=round(ms / floor_ms, 3),
                 ratio_to_bf16_floor=round(ms / bf16_floor_ms, 3), lora_floor_ms=round(lora_floor, 3), floor_with_lora_ms=round(floor_ms + lora_floor, 3),
                 ratio_to_floor_with_lora=round(ms / (floor_ms + lora_floor), 3),
                 kv_read_gb=round(kv_bytes / 1e9, 3), kv_floor_ms=round(kv_floor, 3),
                 ratio_to_floor_with_kv=round(ms / (floor_ms + kv_floor), 3), **attention,
                 run_medians_ms=[round(x, 3) for x in replay],
                 spread=round((max(replay) - min(replay)) / min(replay), 4),
                 execute_ms=round(statistics.median(whole), 3),
                 execute_spread=round((max(whole) - min(whole)) / min(whole), 4),
                 host_prepare_ms=round(host, 3))
            for s in seqs:
                blocks.release(s.request_id)

    # The same decode step eagerly (no graph), for comparison
    batch = args.eager_batch
    seqs = [Seq(f"e{i}", torch.randint(0, 128000, (args.context,)).tolist(), i % 32) for i in range(batch)]
    for s in seqs:
        blocks.allocate(s.request_id, args.context + 1)
        s.num_cached, s.output_ids = args.context, [1]
    plan = StepPlan(decode=[Chunk(s, args.context, 1) for s in seqs])
    cuda_graphs, runner.cuda_graphs = runner.cuda_graphs, None
    eager = [statistics.median(host_ms(lambda: runner.execute(plan), 10)) for _ in range(3)]
    emit(variant="decode_eager", batch=batch, distinct=32, ms=round(statistics.median(eager), 3),
         run_medians_ms=[round(x, 3) for x in eager], ratio_to_floor=round(statistics.median(eager) / floor_ms, 3))
    if os.environ.get("PROFILE"):
        profile_table(lambda: runner.execute(plan), "eager decode, 32 distinct adapters")
    runner.cuda_graphs = cuda_graphs

    if args.out:
        meta = {"command": "python -m bench.engine.decode " + " ".join(os.sys.argv[1:]),
                "commit": os.environ.get("LORA_GIT_COMMIT", ""), "device": torch.cuda.get_device_name(),
                "shape": args.shape, "quantization": args.quantization}
        with open(args.out, "w") as f:
            json.dump({**meta, "results": lines}, f, indent=1)
    return lines


if __name__ == "__main__":
    main()
