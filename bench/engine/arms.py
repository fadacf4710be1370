"""The benchmark's arms, all at the same device adapter memory M and the same host cache, and how one
run of an arm is played.

Every arm runs on one engine: the adapter pool, host arena and KV cache are the same objects, so the
memory is equal by construction. Between runs the engine is idle, its device pool (and, for a cold
host tier, its host cache) is emptied, and `prefetch` is switched to the arm's setting; that flag is
read at each step, hint and admission (app/engine/engine.py), never cached.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from app.engine.config import EngineConfig
from app.engine.engine import LLMEngine
from app.sampling.params import SamplingParams
from bench.engine.driver import RunRecord, run_trace
from bench.workloads import Arrival, random_prompt


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    prefetch: bool  # async loads, planned from the waiting queue (and hints); False: load on a miss, blocking
    hints: bool  # the driver sends engine.hint([adapter]) hint_lead_s before each arrival
    preload: bool = False  # every adapter made resident before the clock starts (needs N to fit in M)

    def config(self) -> dict:
        return {"label": self.label, "prefetch": self.prefetch, "hints": self.hints, "preload": self.preload}


ARMS = {a.name: a for a in (
    Arm("B", "LRU, sync loads", prefetch=False, hints=False),
    Arm("A0", "prefetch from the queue", prefetch=True, hints=False),
    Arm("A", "prefetch + hints", prefetch=True, hints=True),
    Arm("D", "all resident", prefetch=False, hints=False, preload=True),
)}


def build_engine(base: EngineConfig, num_slots: int | None, prefetch: bool, adapter_names: Sequence[str],
                 adapter_dir) -> LLMEngine:
    """An engine with every adapter registered and first-call costs paid; num_slots None keeps base's pool size."""
    engine = LLMEngine(replace(base, prefetch=prefetch, **({} if num_slots is None else {"num_slots": num_slots})))
    for name in adapter_names:
        engine.register_adapter(name, str(adapter_dir / name))
    _warm_up(engine, adapter_names[0])
    return engine


def use_arm(engine: LLMEngine, arm: Arm) -> None:
    """Switch an idle engine to the arm's loading policy."""
    assert not engine.has_work(), "switch arms on an idle engine"
    engine.config = replace(engine.config, prefetch=arm.prefetch)


def close_engine(engine: LLMEngine) -> None:
    """Shut down and free the engine; the caller must hold no other reference to it."""
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pool_info(engine: LLMEngine) -> dict:
    """What the device pool and host arena really hold, read back from the engine."""
    residency = engine.residency
    page_nbytes = residency.layout.page_nbytes(engine.dtype)
    return {"pages": residency.pool.num_pages, "slots": len(residency.pool), "page_nbytes": page_nbytes,
            "page_rows": residency.layout.page_rows, "adapter_memory_bytes": residency.pool.num_pages * page_nbytes,
            "max_rank_adapter_bytes": residency.layout.adapter_nbytes(engine.config.max_rank, engine.dtype),
            "host_arena_bytes": residency.host_cache.budget_bytes,
            "host_pinned_bytes": residency.host_cache.arena.pinned_bytes}


def fits(engine: LLMEngine, adapter_names: Sequence[str]) -> bool:
    """Whether all these adapters can be resident at once (arm D)."""
    pool = engine.residency.pool
    return len(adapter_names) <= len(pool) and sum(map(engine.residency.pages_of, adapter_names)) <= pool.num_pages


def model_shape(engine: LLMEngine) -> dict:
    c = engine.model_config
    return {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "vocab": c.vocab_size,
            "dtype": str(engine.dtype), "device": str(engine.device)}


def _drain(engine: LLMEngine) -> None:
    while engine.has_work():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"warm-up request {output.request_id} failed: {output.error}")


def _warm_up(engine: LLMEngine, adapter_id: str) -> None:
    """Base-only, LoRA-only and mixed batches through prefill and decode, so no run pays first-call costs."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, adapters in enumerate(([None, None], [adapter_id, adapter_id], [None, adapter_id])):
        for j, adapter in enumerate(adapters):
            engine.add_request(list(range(8, 24 + 8 * j)), adapter, params, f"warm-{i}-{j}")
        _drain(engine)
    reset_residency(engine, [adapter_id])


def reset_residency(engine: LLMEngine, adapter_names: Sequence[str], keep_host: bool = False) -> None:
    """Empty the device pool (and the host cache unless keep_host) and drop stale hints, so a run starts cold.

    Uses the paths unregistration takes (`Residency.forget`, or the pipeline's eviction alone); the
    adapters stay registered.
    """
    assert not engine.has_work(), "reset needs an idle engine"
    residency = engine.residency
    for name in adapter_names:
        if not keep_host:
            residency.forget(name)
        elif residency.pool.lookup(name) is not None:
            residency.pipeline.evict(name)
    engine.hints.clear()


def warm_host(engine: LLMEngine, adapter_names: Sequence[str]) -> int:
    """Read adapters into the host cache before the clock starts; returns how many are cached after."""
    cache = engine.residency.host_cache
    futures = [cache.fetch(name) for name in adapter_names]
    for name, future in zip(adapter_names, futures):
        future.result()
        cache.collect(name)
        cache.start_deferred()
    return sum(name in cache for name in adapter_names)


def drop_page_cache(adapter_dir: Path, adapter_names: Sequence[str]) -> None:
    """Ask the kernel to drop the adapters' files from its page cache, so the next read goes to the disk."""
    for name in adapter_names:
        for path in (adapter_dir / name).iterdir():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def preload(engine: LLMEngine, adapter_names: Sequence[str]) -> None:
    """Arm D: one one-token request per adapter before the clock starts, so all are resident."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(adapter_names):
        engine.add_request([8, 9, 10, 11], name, params, f"preload-{i}")
    _drain(engine)
    missing = [n for n in adapter_names if engine.residency.pool.lookup(n) is None]
    assert not missing, f"preload left {missing} out of the pool"


def unused_resident_bytes(engine: LLMEngine) -> int:
    """Device bytes of adapters loaded and never used (a prefetch that the run's end left unredeemed)."""
    residency = engine.residency
    page_nbytes = residency.layout.page_nbytes(engine.dtype)
    return sum(len(s.pages) * page_nbytes for i in residency.pool.occupied()
               for s in [residency.pool.slots[i]] if not s.used_since_load)


def play(engine: LLMEngine, arm: Arm, arrivals: list[Arrival], adapter_names: Sequence[str], num_adapters: int,
         vocab: np.ndarray, prompt_seed: int, hint_lead_s: float, keep_host: bool = False,
         on_finish: Callable[[], None] | None = None, idle_poll_s: float = 0.0) -> RunRecord:
    """One run of `arm` on a trace over the first `num_adapters` adapters, from an empty device pool."""
    names = list(adapter_names[:num_adapters])
    reset_residency(engine, adapter_names, keep_host)
    use_arm(engine, arm)
    if arm.preload:
        preload(engine, names)
    rng = np.random.default_rng(prompt_seed)  # the same prompts for every arm of a trace
    prompts = [random_prompt(a.prompt_len, vocab, rng) for a in arrivals]
    engine.residency.metrics.load_seconds.clear()  # a recent-loads window: keep this run's alone
    record = run_trace(engine, arrivals, names, prompts, hint_lead_s if arm.hints else 0.0, on_finish, idle_poll_s)
    record.load_s = list(engine.residency.metrics.load_seconds)
    record.unused_resident_bytes = unused_resident_bytes(engine)
    return record
