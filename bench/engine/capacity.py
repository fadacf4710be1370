"""How many adapters are resident at equal device bytes: pages of rank rows against slots padded to max_rank.

Runs on CPU, with the real slot pool and eviction policy (prefetch/slot_pool.py, prefetch/policy.py) and
Llama-3-8B target shapes for the bytes (no tensors are allocated): a stream of requests over many more
adapters than fit churns the pool by LRU, and we count the adapters resident after each load. Then the tiny
demo's engine, for real: the 8 demo adapters (ranks 4, 8, 16) hinted into the bytes of 4 rank-16 slots.
Also reports the host side: what torch's caching host allocator would pin for each adapter (a power of
two) against the arena's whole pages.

    python -m bench.engine.capacity   # -> bench/results/cpu-adapter-capacity.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig

from app.engine.config import GiB
from app.adapters.targets import target_shapes
from bench.common import REPO_DEMO, write_result
from prefetch.layout import PageLayout
from prefetch.policy import plan, view_of
from prefetch.slot_pool import SlotPool
from routing.wire import Hint

LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)
POPULATIONS = {  # name: (max_rank, {rank: weight})
    "slora-uniform-8-64": (64, {8: 1, 16: 1, 32: 1, 64: 1}),  # S-LoRA's mixed-rank setup
    "skewed-8-64": (64, {8: 6, 16: 3, 32: 1, 64: 1}),  # most adapters small, a few large
    "demo-4-16": (16, {4: 1, 8: 1, 16: 1}),  # the demo's ranks
    "uniform-16": (16, {16: 1}),  # one rank: paging gains nothing, and must lose nothing
}


def churn(pool: SlotPool, ranks: dict[str, int], layout: PageLayout, requests: int, rng: random.Random) -> dict:
    """LRU churn over `ranks`' adapters, each request loading its adapter if absent (evictions by the policy)."""
    names = list(ranks)
    resident = []
    for i in range(requests):
        adapter = rng.choice(names)
        slot = pool.lookup(adapter)
        if slot is None:
            (load,) = plan(view_of(pool), [adapter], {adapter: layout.pages_for(ranks[adapter])}, max_loads=1).loads
            for victim in load[1]:
                pool.evict(victim)
            slot = pool.begin_load(adapter, layout.pages_for(ranks[adapter]))
            pool.finish_load(slot)
        pool.pin(slot)
        pool.unpin(slot)
        if i >= requests // 4:  # after warm-up
            resident.append(len(pool.adapter_to_slot))
    pool.check_invariants()
    used = pool.num_pages - pool.free_page_count()
    return {"resident_mean": statistics.fmean(resident), "resident_min": min(resident),
            "pages_used_at_end": used, "pages_total": pool.num_pages}


def simulate(name: str, max_rank: int, weights: dict[int, int], memory_bytes: int, page_rows: int,
             num_adapters: int, requests: int, seed: int) -> dict:
    layout = PageLayout(target_shapes(LLAMA3_8B), max_rank, page_rows)
    page_bytes = layout.page_nbytes(torch.bfloat16)
    rng = random.Random(seed)
    ranks = {f"a{i}": rng.choices(list(weights), list(weights.values()))[0] for i in range(num_adapters)}
    slots = memory_bytes // layout.adapter_nbytes(max_rank, torch.bfloat16)
    padded = churn(SlotPool(slots * layout.max_pages, slots), ranks, layout, requests, random.Random(seed + 1))
    paged = churn(SlotPool(memory_bytes // page_bytes), ranks, layout, requests, random.Random(seed + 1))
    mean_rank = statistics.fmean(ranks.values())
    return {
        "population": name, "max_rank": max_rank, "rank_weights": weights, "mean_rank": round(mean_rank, 2),
        "memory_bytes": memory_bytes, "page_rows": page_rows, "page_bytes": page_bytes,
        "max_rank_adapter_bytes": layout.adapter_nbytes(max_rank, torch.bfloat16),
        "padded_slots": slots, "padded": padded, "paged": paged,
        "gain": round(paged["resident_mean"] / padded["resident_mean"], 2),
        "ideal_gain": round(max_rank / mean_rank, 2),  # if every adapter took exactly its rank's bytes
    }


def host_rounding(page_rows: int) -> list[dict]:
    """Pinned bytes per adapter: torch.empty(pin_memory=True) rounds to a power of two; the arena takes pages."""
    layout = PageLayout(target_shapes(LLAMA3_8B), 64, page_rows)
    rows = []
    for rank in (8, 16, 32, 64):
        exact = layout.adapter_nbytes(rank, torch.bfloat16)
        caching = 1 << (exact - 1).bit_length()
        rows.append({"rank": rank, "arena_bytes": exact, "caching_allocator_bytes": caching,
                     "caching_over_arena": round(caching / exact, 3)})
    return rows


def demo_engine(demo_dir: Path) -> dict:
    """The tiny demo's engine on CPU: hint all 8 demo adapters into the bytes of 4 rank-16 slots."""
    from app.engine.config import EngineConfig
    from app.engine.engine import LLMEngine

    manifest = json.loads((demo_dir / "demo.json").read_text())
    padded = EngineConfig(base_model=str(demo_dir / "base"), adapter_roots=(str(demo_dir / "adapters"),),
                          device="cpu", dtype="float32", max_rank=16, max_inflight_loads=8, num_slots=4)
    result = {}
    for label in ("padded", "paged"):
        config = padded if label == "padded" else replace(
            padded, num_slots=None, adapter_memory_bytes=result["padded"]["pool_bytes"])
        engine = LLMEngine(config)
        for adapter in manifest["adapters"]:
            engine.register_adapter(adapter["name"], str(demo_dir / adapter["path"]))
        engine.hint([Hint(a["name"]) for a in manifest["adapters"]])
        while engine.has_work():
            engine.step()
        engine.check_invariants()
        result[label] = {"pool_bytes": engine.lora.nbytes(), "resident": len(engine.routing_stats().resident),
                         "ranks": {a["name"]: a["rank"] for a in manifest["adapters"]}}
        engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory-gib", type=float, nargs="+", default=[4.0, 16.0])
    p.add_argument("--page-rows", type=int, default=4)
    p.add_argument("--adapters", type=int, default=4000, help="distinct adapters in the population")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = [simulate(name, max_rank, weights, int(gib * GiB), args.page_rows, args.adapters, args.requests, args.seed)
            for gib in args.memory_gib for name, (max_rank, weights) in POPULATIONS.items()]
    for r in rows:
        print(f"{r['population']:>20} {r['memory_bytes'] / GiB:5.1f} GiB: padded {r['padded']['resident_mean']:7.1f}"
              f"  paged {r['paged']['resident_mean']:7.1f}  gain {r['gain']:.2f}x (ideal {r['ideal_gain']:.2f}x)")
    host = host_rounding(args.page_rows)
    demo = demo_engine(Path(REPO_DEMO) / "tiny")
    print("host pinning:", [(h["rank"], h["caching_over_arena"]) for h in host])
    print("demo engine:", {k: v["resident"] for k, v in demo.items()})
    print(write_result("adapter-capacity", {"shapes": "llama3-8b", "dtype": "bfloat16", "simulated": rows,
                                            "host_pinning": host, "demo_engine": demo}))


if __name__ == "__main__":
    main()
