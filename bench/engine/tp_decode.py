"""The decode step of a tensor-parallel replica against its floor: a published model's shapes (`--shape`, Llama-3-70B
by default) sharded over `--tp` GPUs of one host, random bf16 weights built at each rank's sizes (no checkpoint:
a 70B one is 141 GB), rank-16 adapters on all seven targets. Each rank is a process with its own model runner
(paged KV cache, segmented LoRA, CUDA graphs with the all-reduces inside), all ranks replaying the same steps.

Floor: a `tp`-th of the whole model's weight bytes over the HBM read rate, plus the measured time of
the step's all-reduces (two per layer, [bucket, hidden] bf16, in one CUDA graph). Also reported: each rank's own
weight bytes (its shards, plus the replicated embeddings and lm_head) over the same rate. Rank 0 prints one JSON line
per measurement; --out writes them all.

    python -m bench.engine.tp_decode --tp 4 --shape llama-3-70b --batches 32 --out bench/results/h200-x4-tp-decode.json
    python -m bench.engine.tp_decode --tp 2 --shape llama-3-8b --batches 32 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.adapters.targets import target_shapes
from app.engine.kv_blocks import BlockManager
from app.engine.model_runner import ModelRunner
from app.engine.scheduler import Chunk, StepPlan
from app.model.architectures import check_supported
from app.model.attention import PagedKVCache
from app.model.lora import LoRASlots
from app.model.tensor_parallel import ShardPlan, TensorParallel, local_config, use_row_parallel
from app.model.kernels import lora as lora_kernels
from bench.engine.decode import SHAPES, Seq, build_model, cuda_ms, shape_config, weight_bytes
from prefetch.layout import PageLayout


def random_shard(args, rank: int, dev: torch.device):
    """Rank `rank`'s model: built at its local sizes, random bf16 weights (the same on every rank where replicated),
    row-parallel projections all-reducing over the default group."""
    config = shape_config(args.shape, args.layers)
    arch = check_supported(config)
    plan = ShardPlan(arch, config, TensorParallel(rank, args.tp))
    _, model_class, _ = SHAPES[args.shape]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = model_class(local_config(config, plan)).eval()
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    use_row_parallel(model, plan)
    return config, model


def all_reduce_ms(args, hidden: int, bucket: int, dev: torch.device) -> float:
    """GPU ms of one decode step's all-reduces (two per layer) of [bucket, hidden] bf16, replayed from a graph."""
    x = torch.zeros(bucket, hidden, dtype=torch.bfloat16, device=dev)
    layers = shape_config(args.shape, args.layers).num_hidden_layers

    def step():
        for _ in range(2 * layers):
            dist.all_reduce(x)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return statistics.median(cuda_ms(graph.replay, args.iters))


def rank_main(rank: int, args, init: str, out: str | None) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=args.tp)
    dist.all_reduce(torch.zeros(1, device=dev))  # NCCL's communicator, before any capture
    lines = []

    def emit(**kw):
        if rank == 0:
            print(json.dumps(kw), flush=True)
            lines.append(kw)

    buf = torch.empty(4 << 30, dtype=torch.bfloat16, device=dev).normal_()
    read_gbs = buf.numel() * 2 / (statistics.median(cuda_ms(buf.sum, 10)) / 1e3) / 1e9
    del buf
    torch.cuda.empty_cache()
    whole, model = random_shard(args, rank, dev)
    layout = PageLayout(target_shapes(model.config), max_rank=args.rank)
    max_batch = max(args.batches)
    lora = LoRASlots(model, layout, args.slots * layout.max_pages, args.slots,  # t_cap: the prefills and warm-up
                     t_cap=max(8 * args.context, lora_kernels.DECODE_T_MAX + 8) + max_batch)
    gen = torch.Generator(device=dev).manual_seed(1)
    for slot in range(args.slots):
        pages = range(slot * layout.max_pages, (slot + 1) * layout.max_pages)
        host = [torch.randn(layout.page_numel, generator=gen, device=dev).mul_(0.01).to(torch.bfloat16) for _ in pages]
        lora.write_slot(slot, list(pages), host, torch.full((len(layout.modules),), 2.0), args.rank)
    per_seq = -(-(args.context + 2) // 16)
    blocks = BlockManager(2 + per_seq * (max_batch + 8), 16)
    cache = PagedKVCache.for_model(model.config, blocks.num_blocks, 16, torch.bfloat16, dev)
    started = time.perf_counter()
    runner = ModelRunner(model, lora, blocks, cache, max_batch, whole.max_position_embeddings, use_graphs=True,
                         compile_decode=args.compile)
    rank_bytes = weight_bytes(model)
    emit(variant="setup", shape=args.shape, tp=args.tp, hbm_read_gbs=round(read_gbs),
         whole_weights_gb=round(args.whole_bytes / 1e9, 2), rank_weights_gb=round(rank_bytes / 1e9, 2),
         graph_capture_s=round(time.perf_counter() - started, 1), buckets=runner.graph_batches,
         gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    for batch in args.batches:
        reduce_ms = None
        for distinct in sorted({0, min(batch, 32)}):
            torch.manual_seed(2)  # every rank feeds the same tokens
            seqs = [Seq(f"d{batch}-{distinct}-{i}", torch.randint(0, 32000, (args.context,)).tolist(),
                        i % distinct if distinct else None) for i in range(batch)]
            for s in seqs:
                blocks.allocate(s.request_id, args.context + 1)
            for i in range(0, batch, 8):
                runner.execute(StepPlan(prefill=[Chunk(s, 0, args.context) for s in seqs[i:i + 8]]))
            for s in seqs:
                s.num_cached, s.output_ids = args.context, [1]
            plan = StepPlan(decode=[Chunk(s, args.context, 1) for s in seqs])
            graph = runner.cuda_graphs.graph_for(runner.prepare(plan))
            runner.execute(plan)
            if reduce_ms is None:  # the bucket's all-reduces, every rank at once
                reduce_ms = all_reduce_ms(args, whole.hidden_size, graph.batch, dev)
            replays = [statistics.median(cuda_ms(graph.graph.replay, args.iters)) for _ in range(args.runs)]
            ms = statistics.median(replays)
            weights_floor = args.whole_bytes / args.tp / read_gbs / 1e6
            floor = weights_floor + reduce_ms
            emit(variant="decode", shape=args.shape, tp=args.tp, batch=batch, bucket=graph.batch,
                 context=args.context, distinct=distinct, ms=round(ms, 3), floor_ms=round(floor, 3),
                 ratio_to_floor=round(ms / floor, 3), weights_floor_ms=round(weights_floor, 3),
                 all_reduce_ms=round(reduce_ms, 3), rank_weights_floor_ms=round(rank_bytes / read_gbs / 1e6, 3),
                 run_medians_ms=[round(x, 3) for x in replays])
            for s in seqs:
                blocks.release(s.request_id)
    if rank == 0 and out:
        meta = {"command": "python -m bench.engine.tp_decode " + " ".join(os.sys.argv[1:]),
                "commit": os.environ.get("LORA_GIT_COMMIT", ""), "device": torch.cuda.get_device_name()}
        with open(out, "w") as f:
            json.dump({**meta, "results": lines}, f, indent=1)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=4, help="GPUs the model is sharded over")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3-70b")
    parser.add_argument("--batches", type=int, nargs="+", default=[32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decoder before capture")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs; this host has {torch.cuda.device_count()}")
    # The whole model on the meta device: its bytes, no memory.
    _, whole = build_model(argparse.Namespace(shape=args.shape, layers=args.layers), torch.device("meta"))
    args.whole_bytes = weight_bytes(whole)
    init = f"file://{tempfile.mkdtemp(prefix='tp-decode-')}/init"
    mp.spawn(rank_main, args=(args, init, args.out), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
