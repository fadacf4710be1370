"""The benchmark's arms: how each one configures the engine, and how one run of an arm is played.

A gets S slots plus hints and async prefetch; B, its equal-memory counterpart as the issue counts
it, gets 2S slots of plain LRU with synchronous loads; C is B's policy with A's S slots.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from app.config import EngineConfig
from app.engine import LLMEngine
from app.sampling import SamplingParams
from bench.driver import RunRecord, run_trace
from bench.workloads import Arrival, random_prompt, without_adapters


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    prefetch: bool
    hints: bool  # the driver sends engine.hint([adapter]) hint_lead_s before each arrival
    slot_factor: int = 1  # slots = slot_factor * S ...
    slots_are_n: bool = False  # ... or N (arm D)
    preload: bool = False  # every adapter made resident before the clock starts
    base_only: bool = False  # every request on the base model

    def num_slots(self, slots: int, num_adapters: int) -> int:
        return num_adapters if self.slots_are_n else self.slot_factor * slots

    def applies(self, slots: int, num_adapters: int) -> bool:
        return not self.slots_are_n or num_adapters <= slots

    def engine_key(self, slots: int, num_adapters: int) -> tuple[int, bool]:
        """Arms with the same key share one engine (its residency is reset between runs)."""
        return self.num_slots(slots, num_adapters), self.prefetch


ARMS = {a.name: a for a in (
    Arm("A", "prefetch + hints, S slots", prefetch=True, hints=True),
    Arm("B", "LRU, sync loads, 2S slots", prefetch=False, hints=False, slot_factor=2),
    Arm("C", "sync loads, S slots", prefetch=False, hints=False),
    Arm("D", "all resident (N <= S)", prefetch=False, hints=False, slots_are_n=True, preload=True),
    Arm("E", "base model, no LoRA", prefetch=False, hints=False, base_only=True),
)}


def build_engine(base: EngineConfig, num_slots: int, prefetch: bool, adapter_names: Sequence[str],
                 adapter_dir) -> LLMEngine:
    engine = LLMEngine(replace(base, num_slots=num_slots, prefetch=prefetch))
    for name in adapter_names:
        engine.register_adapter(name, str(adapter_dir / name))
    _warm_up(engine, adapter_names[0])
    return engine


class Engines:
    """Engines by (slots, prefetch), built on demand; at most `max_alive` at once (an 8B base fills a GPU).

    Arms that share a key share an engine, whose residency each run resets.
    """

    def __init__(self, config: EngineConfig, names: Sequence[str], adapter_dir: Path, max_alive: int = 2):
        self.config, self.names, self.adapter_dir, self.max_alive = config, list(names), adapter_dir, max_alive
        self.alive: dict[tuple[int, bool], LLMEngine] = {}  # least recently used first
        self.build_s: list[float] = []
        self.shape: dict | None = None

    def get(self, key: tuple[int, bool]) -> LLMEngine:
        engine = self.alive.pop(key, None)
        if engine is None:
            while len(self.alive) >= self.max_alive:
                close_engine(self.alive.pop(next(iter(self.alive))))
            start = time.perf_counter()
            engine = build_engine(self.config, *key, self.names, self.adapter_dir)
            self.build_s.append(time.perf_counter() - start)
            self.shape = self.shape or model_shape(engine)
        self.alive[key] = engine
        return engine

    def close(self) -> None:
        while self.alive:
            close_engine(self.alive.pop(next(iter(self.alive))))


def model_shape(engine: LLMEngine) -> dict:
    c = engine.model_config
    return {"hidden": c.hidden_size, "layers": c.num_hidden_layers, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "vocab": c.vocab_size,
            "dtype": str(engine.dtype), "device": str(engine.device),
            "slot_bytes": engine.residency.layout.adapter_nbytes(engine.config.max_rank, engine.dtype)}


def close_engine(engine: LLMEngine) -> None:
    """Shut down and free the engine; the caller must hold no other reference to it."""
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def reset_residency(engine: LLMEngine, adapter_names: Sequence[str]) -> None:
    """Empty the slots and host cache and drop stale hints, so every run starts cold.

    Uses `Residency.forget`, the path unregistration takes; the adapters stay registered.
    """
    assert not engine.has_work(), "reset needs an idle engine"
    for name in adapter_names:
        engine.residency.forget(name)
    engine.hints.clear()


def preload(engine: LLMEngine, adapter_names: Sequence[str]) -> None:
    """Arm D: one one-token request per adapter before the clock starts, so all are resident."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(adapter_names):
        engine.add_request([8, 9, 10, 11], name, params, f"preload-{i}")
    _drain(engine)
    missing = [n for n in adapter_names if engine.residency.pool.lookup(n) is None]
    assert not missing, f"preload left {missing} out of the slots"


def play(engine: LLMEngine, arm: Arm, arrivals: list[Arrival], adapter_names: Sequence[str], num_adapters: int,
         vocab: np.ndarray, prompt_seed: int, hint_lead_s: float,
         on_finish: Callable[[], None] | None = None, idle_poll_s: float = 0.0) -> RunRecord:
    """One run of `arm` on a trace over the first `num_adapters` adapters, from a cold residency."""
    names = list(adapter_names[:num_adapters])
    reset_residency(engine, adapter_names)
    if arm.preload:
        preload(engine, names)
    if arm.base_only:
        arrivals = without_adapters(arrivals)
    rng = np.random.default_rng(prompt_seed)  # the same prompts for every arm of a trace
    prompts = [random_prompt(a.prompt_len, vocab, rng) for a in arrivals]
    return run_trace(engine, arrivals, names, prompts, hint_lead_s if arm.hints else 0.0, on_finish, idle_poll_s)
