"""Executes residency plans: disk -> host cache -> device slot, asynchronously, driven by the engine loop."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from prefetch.host_cache import HostCache
from prefetch.metrics import PrefetchMetrics
from prefetch.policy import Plan, plan, view_of
from prefetch.slot_pool import SlotPool, SlotState


@dataclass
class Load:
    adapter_id: str
    slot: int
    is_prefetch: bool
    host: Future
    transfer: object | None = None  # a copier Transfer once the host copy is in hand
    started_at: float = field(default_factory=time.perf_counter)


class PrefetchPipeline:
    """Owned by the engine loop: every method runs on the engine thread.

    A slot is usable by a forward pass once it is READY, or LOADING with its device copy already
    issued: the forward then waits on the copy's event on the device, not on the host.
    """

    def __init__(self, pool: SlotPool, host_cache: HostCache, copier, metrics: PrefetchMetrics, max_inflight: int = 2):
        self.pool = pool
        self.host_cache = host_cache
        self.copier = copier
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.loads: dict[int, Load] = {}
        self.failures: dict[str, Exception] = {}  # adapter_id -> why its last load failed
        self._slot_nbytes = [0] * len(pool)  # bytes of the load now in each slot
        self._largest_load = 1  # bytes of the largest adapter copied so far, to size host warming

    # --- planning -----------------------------------------------------------------------------

    def prefetch(self, demand: list[str]) -> Plan:
        """Plan and start loads for the highest-priority demanded adapters that are not resident."""
        demand = [a for a in demand if a not in self.failures]
        result = plan(view_of(self.pool), demand, self.max_inflight - len(self.loads))
        for adapter_id, slot in result.loads:
            self.start_load(adapter_id, slot, is_prefetch=True)
        self._warm_host(demand)
        return result

    def _warm_host(self, demand: list[str]) -> None:
        """Read demanded adapters that got no slot into the host cache now.

        Disk -> host is the slow tier (hundreds of ms for an 8B-shape adapter, against ~2 ms for the
        copy), so when every slot is busy a hint still pays off: the later load is only the copy.
        """
        budget = self.host_cache.budget_bytes // max(self._largest_load, 1)
        for adapter_id in dict.fromkeys(demand):
            if budget <= 0 or self.host_cache.pending_reads() >= self.host_cache.workers:
                break
            if self.pool.lookup(adapter_id) is None and not self.host_cache.has(adapter_id):
                self.host_cache.fetch(adapter_id)
            budget -= 1

    def start_load(self, adapter_id: str, slot: int, is_prefetch: bool) -> None:
        evicted, was_used = self.pool.begin_load(slot, adapter_id)
        if evicted is not None:
            self.metrics.evictions += 1
            if not was_used:
                self.metrics.wasted_prefetches += 1
                self.metrics.wasted_prefetch_bytes += self._slot_nbytes[slot]
        self.loads[slot] = Load(adapter_id, slot, is_prefetch, self.host_cache.fetch(adapter_id))
        self.metrics.loads_started += 1

    def evict(self, adapter_id: str) -> bool:
        """Drop an unpinned, ready adapter from its slot (unregistration). False if it is busy."""
        slot = self.pool.lookup(adapter_id)
        if slot is None:
            return True
        if not self.pool.can_evict(slot):
            return False
        self.pool.evict(slot)
        return True

    # --- progress -----------------------------------------------------------------------------

    def poll(self) -> None:
        """Advance every load one stage without blocking."""
        self.host_cache.absorb_finished({load.adapter_id for load in self.loads.values() if load.transfer is None})
        for load in list(self.loads.values()):
            if load.transfer is None:
                if load.host.done():
                    self._issue(load)
            elif load.transfer.is_done():
                self._finish(load)

    def _issue(self, load: Load) -> None:
        try:
            host = load.host.result()  # the read's own result: LRU eviction cannot take it from us
            self.host_cache.adopt(load.adapter_id)
        except Exception as e:  # the adapter's files vanished or changed: fail it alone
            del self.loads[load.slot]
            self.pool.fail_load(load.slot)
            self.host_cache.discard(load.adapter_id)
            self.failures[load.adapter_id] = e
            self.metrics.load_failures += 1
            return
        self._slot_nbytes[load.slot] = host.nbytes
        self._largest_load = max(self._largest_load, host.nbytes)
        load.transfer = self.copier.start(load.slot, host)

    def _finish(self, load: Load) -> None:
        del self.loads[load.slot]
        self.pool.finish_load(load.slot)
        self.metrics.record_h2d(load.transfer.nbytes, load.transfer.h2d_seconds())
        self.metrics.load_seconds.append(time.perf_counter() - load.started_at)

    def is_usable(self, slot: int) -> bool:
        state = self.pool.slots[slot].state
        if state is SlotState.READY:
            return True
        load = self.loads.get(slot)
        return load is not None and load.transfer is not None

    def wait_usable(self, slot: int, timeout_s: float | None = None) -> None:
        """Block the host until the slot's device copy is issued, or timeout_s passes (stall path)."""
        load = self.loads.get(slot)
        if load is None or load.transfer is not None:
            return
        try:
            load.host.exception(timeout=timeout_s)  # errors surface in _issue
        except FutureTimeout:
            return
        self._issue(load)

    def wait_any(self, timeout_s: float | None) -> None:
        """Block until some load in flight makes progress, or timeout_s passes."""
        pending = [load.host for load in self.loads.values() if load.transfer is None]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
        else:
            for load in list(self.loads.values()):
                load.transfer.wait()
        self.poll()

    def before_forward(self, slots) -> None:
        """Order the forward after in-flight copies into the slots it reads."""
        for slot in slots:
            load = self.loads.get(slot)
            if load is not None and load.transfer is not None:
                load.transfer.make_compute_wait()

    def after_forward(self, slots) -> None:
        self.copier.mark_used(slots)

    def drain(self) -> None:
        """Wait for every load to settle (tests and shutdown)."""
        while self.loads:
            for load in list(self.loads.values()):
                if load.transfer is None:
                    load.host.exception()
                    self._issue(load)
                else:
                    load.transfer.wait()
            self.poll()

    def check_invariants(self) -> None:
        for slot, load in self.loads.items():
            s = self.pool.slots[slot]
            assert s.state is SlotState.LOADING and s.adapter_id == load.adapter_id, f"load {load} vs slot {s}"
        for i, s in enumerate(self.pool.slots):
            if s.state is SlotState.LOADING:
                assert i in self.loads, f"slot {i} loading with no load in flight"
