"""Residency of adapters for one engine: host cache + slot pool + prefetch pipeline, one facade.

All methods run on the engine thread, which owns this object.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import torch

from prefetch.copier import make_copier
from prefetch.host_cache import HostAdapter, HostCache
from prefetch.layout import SlotLayout
from prefetch.metrics import PrefetchMetrics
from prefetch.pipeline import PrefetchPipeline
from prefetch.policy import plan, view_of
from prefetch.slot_pool import SlotPool, SlotState

# Validated weights are finite, but a huge finite value could still overflow x @ A to inf in a slot
# that other rows multiply by zero (inf * 0 = NaN). No trained adapter comes near this bound.
MAX_ABS_WEIGHT = 1e6


class Residency:
    def __init__(self, config, shapes: Mapping[str, tuple[int, int]],
                 read_parts: Callable[[str], Mapping], device: torch.device, dtype: torch.dtype,
                 steps_left: Callable[[int], int] = lambda slot: 0):
        """read_parts(adapter_id) -> what SlotLayout.pack takes; called on disk worker threads.
        steps_left(slot) -> how many more steps the requests pinning `slot` may run (the engine knows)."""
        self.layout = SlotLayout(shapes, config.max_rank)
        self.device, self.dtype = device, dtype
        self.prefetch_enabled = config.prefetch
        self._read_parts = read_parts
        self.pool = SlotPool(config.num_slots)
        self.metrics = PrefetchMetrics()
        self.host_cache = HostCache(config.host_cache_bytes, self._read, workers=config.disk_workers)
        self._max_inflight = config.max_inflight_loads
        self.pipeline: PrefetchPipeline | None = None
        self.draining: int | None = None  # a pinned slot that takes no new requests, so it can be reused
        self._steps_left = steps_left

    def attach(self, write_slot) -> None:
        copier = make_copier(self.device, write_slot, len(self.pool))
        self.pipeline = PrefetchPipeline(self.pool, self.host_cache, copier, self.metrics, self._max_inflight)

    def _read(self, adapter_id: str) -> HostAdapter:
        """Disk -> packed host buffer (worker thread). A handful of torch calls, each a GIL handoff that
        can wait behind the engine thread, so no per-module work happens here (see AdapterFile)."""
        parts = self._read_parts(adapter_id)
        pin = self.device.type == "cuda"
        flat = torch.empty(self.layout.numel, dtype=self.dtype, pin_memory=pin)
        scales = self.layout.pack(parts, out=flat)
        low, high = (value.item() for value in torch.aminmax(flat))
        if not -MAX_ABS_WEIGHT <= low <= high <= MAX_ABS_WEIGHT:  # also false for NaN and overflowed casts
            raise ValueError(f"weights reach [{low:g}, {high:g}] in {self.dtype}; the limit is ±{MAX_ABS_WEIGHT:g}")
        rank = max((part[2] for part in parts.values()), default=0)
        return HostAdapter(adapter_id, flat, scales.pin_memory() if pin else scales, 0.0, rank)

    # --- per step -------------------------------------------------------------------------------

    def classify_arrival(self, adapter_id: str) -> None:
        state = self.pool.state_of(adapter_id)
        if state is SlotState.READY:
            self.metrics.hint_hits += 1
        elif state is SlotState.LOADING:
            self.metrics.inflight_hits += 1
        else:
            self.metrics.misses += 1

    def poll(self) -> None:
        self.pipeline.poll()
        if self.draining is not None and self.pool.slots[self.draining].pins == 0:
            self.draining = None

    def prefetch(self, demand: list[str]) -> None:
        self.pipeline.prefetch(demand)

    def is_loading(self) -> bool:
        return bool(self.pipeline.loads)

    def acquire(self, adapter_id: str, may_block: bool) -> int | None:
        """Pin the slot of adapter_id if a forward may use it now; None defers the request.

        may_block: load synchronously if needed (prefetch disabled); the wait counts as a stall.
        """
        slot = self.pool.lookup(adapter_id)
        if slot is None and may_block:
            slot = self._load_now(adapter_id)
        if slot is None:
            if self._planned_slot(adapter_id) is None and self.draining is None:
                self._start_draining()
            return None
        if slot == self.draining or not self.pipeline.is_usable(slot):
            return None
        self.pool.pin(slot)
        return slot

    def release(self, slot: int) -> None:
        self.pool.unpin(slot)
        if slot == self.draining and self.pool.slots[slot].pins == 0:
            self.draining = None

    def _planned_slot(self, adapter_id: str) -> int | None:
        loads = plan(view_of(self.pool), [adapter_id], max_loads=1).loads
        return loads[0][1] if loads else None

    def _start_draining(self) -> None:
        """Every slot is pinned: stop feeding the one that frees soonest (fewest steps left to its requests,
        then least recently used), so a waiting adapter gets in. Draining the least recently used slot
        alone let a waiting request sit behind a long generation for seconds on the H100."""
        pinned = [i for i, s in enumerate(self.pool.slots) if s.pins > 0]
        if pinned:
            self.draining = min(pinned, key=lambda i: (self._steps_left(i), self.pool.slots[i].last_used))

    def _load_now(self, adapter_id: str) -> int | None:
        slot = self._planned_slot(adapter_id)
        if slot is None:
            return None
        start = time.perf_counter()
        self.pipeline.start_load(adapter_id, slot, is_prefetch=False)
        self.pipeline.wait_usable(slot)
        if slot in self.pipeline.loads:
            self.pipeline.loads[slot].transfer.wait()
            self.pipeline.poll()
        self.metrics.observe_stall(time.perf_counter() - start)
        return self.pool.lookup(adapter_id)

    def stall_for(self, adapter_id: str | None, timeout_s: float | None = None) -> None:
        """Nothing can run until adapter_id is usable: make sure its load is under way, then wait
        for it (at most timeout_s, so new arrivals are not locked out; None waits until usable)."""
        if adapter_id is None:
            return
        if self.pool.lookup(adapter_id) is None:
            slot = self._planned_slot(adapter_id)
            if slot is None:  # every slot is mid-load or pinned: wait for one to settle
                self.pipeline.wait_any(timeout_s)
                return
            self.pipeline.start_load(adapter_id, slot, is_prefetch=False)
        self.pipeline.wait_usable(self.pool.lookup(adapter_id), timeout_s)

    def before_forward(self, slots) -> None:
        self.pipeline.before_forward(slots)

    def after_forward(self, slots) -> None:
        self.pipeline.after_forward(slots)

    def take_failures(self) -> dict[str, Exception]:
        failures, self.pipeline.failures = self.pipeline.failures, {}
        return failures

    def forget(self, adapter_id: str) -> None:
        """The adapter was unregistered: drop it from every tier."""
        if self.pool.state_of(adapter_id) is SlotState.LOADING:
            self.pipeline.drain()
        self.pipeline.evict(adapter_id)
        self.host_cache.discard(adapter_id)

    # --- introspection --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.pipeline.check_invariants()
        self.host_cache.check_invariants()
        if self.draining is not None:
            assert self.pool.slots[self.draining].pins > 0, "draining an unpinned slot"

    def snapshot(self) -> dict:
        states = [s.state for s in self.pool.slots]
        return {
            **self.metrics.snapshot(self.host_cache.stats),
            "slots_total": len(self.pool),
            "slots_ready": states.count(SlotState.READY),
            "slots_loading": states.count(SlotState.LOADING),
            "slots_pinned": self.pool.pinned_count(),
            "slots": self.pool.snapshot(),
            "host_cache_bytes": self.host_cache.bytes_used,
            "resident_adapters": sorted(a for a, i in self.pool.adapter_to_slot.items()
                                        if self.pool.slots[i].state is SlotState.READY),
            "loading_adapters": sorted(load.adapter_id for load in self.pipeline.loads.values()),
        }

    def shutdown(self) -> None:
        self.host_cache.shutdown()
        self.pipeline.copier.shutdown()
