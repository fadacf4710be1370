"""Executes residency plans: disk -> host arena -> device pages, asynchronously, driven by the engine loop."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterable

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
    issued: the forward then waits on the copy's event on the device, not on the host. A load holds
    its host pages (HostCache.hold) from its start until its copy is done.
    """

    def __init__(self, pool: SlotPool, host_cache: HostCache, copier, metrics: PrefetchMetrics,
                 pages_of: Callable[[str], int], max_inflight: int = 2,
                 began: Callable[[int, str], None] | None = None):
        """began(slot, adapter_id): a load into `slot` began (its pages are the pool's), before its host read."""
        self.pool = pool
        self.began = began
        self.host_cache = host_cache
        self.copier = copier
        self.metrics = metrics
        self.pages_of = pages_of
        self.max_inflight = max_inflight
        self.loads: dict[int, Load] = {}
        self.failures: dict[str, Exception] = {}  # adapter_id -> why its last load failed
        self._slot_nbytes: dict[int, int] = {}  # bytes of the load now in each slot
        self.load_started: dict[int, float] = {}  # slot -> when its latest load began (perf_counter)

    # --- planning -----------------------------------------------------------------------------

    def page_needs(self, adapter_ids: Iterable[str]) -> dict[str, int]:
        needs = {}
        for adapter_id in adapter_ids:
            if adapter_id not in needs:
                try:
                    needs[adapter_id] = self.pages_of(adapter_id)
                except Exception:  # unregistered meanwhile: nothing to plan for it
                    continue
        return needs

    def prefetch(self, demand: list[str], incoming: frozenset = frozenset(), hinted_from: int | None = None) -> Plan:
        """Plan and start loads for the highest-priority demanded adapters that are not resident.
        demand[hinted_from:] are the router's hints (default: none)."""
        queued = frozenset(demand if hinted_from is None else demand[:hinted_from])  # before failures shift it
        demand = [a for a in demand if a not in self.failures]
        needs = self.page_needs([*demand, *incoming])
        result = plan(view_of(self.pool), demand, needs, self.max_inflight - len(self.loads), incoming)
        for adapter_id, victims in result.loads:
            self.start_load(adapter_id, victims, is_prefetch=True)
        self._warm_host(demand, needs, queued)
        return result

    def _warm_host(self, demand: list[str], needs: dict[str, int], queued: frozenset) -> None:
        """Read demanded adapters that got no slot into the host cache now, as far as the arena holds them.

        Disk -> host is the slow tier (far slower than the host -> device copy), so when every slot is busy a
        hint still pays off: the later load is only the copy. A warming read never evicts an adapter wanted
        sooner: with more requests waiting in the router than the host cache holds, reads for later ones would
        evict earlier ones before their requests came, and adapters would be read from disk more than once.
        A read for a request still in the router (not `queued` here) starts only on an idle disk: on a disk-bound
        load it would hold a read worker while requests already here wait for theirs.
        """
        budget = self.host_cache.arena.num_pages
        sooner: set[str] = set()
        for adapter_id in dict.fromkeys(demand):
            reads = self.host_cache.pending_reads()
            if budget <= 0 or reads >= self.host_cache.workers or (reads and adapter_id not in queued):
                break  # queued adapters come first in demand: the rest are hinted, and the disk is busy
            if adapter_id not in needs:
                continue
            if self.pool.lookup(adapter_id) is None and not self.host_cache.has(adapter_id):
                if self.host_cache.fetch(adapter_id, may_defer=False, keep=frozenset(sooner)) is None:
                    break  # the arena is busy with loads or with adapters wanted sooner: nothing to queue
            sooner.add(adapter_id)
            budget -= needs[adapter_id]

    def start_load(self, adapter_id: str, victims: Iterable[int], is_prefetch: bool) -> int:
        """Evict `victims`, then load adapter_id into the slot and pages they (and free ones) leave."""
        for victim in victims:
            nbytes = self._slot_nbytes.pop(victim, 0)
            _, was_used = self.pool.evict(victim)
            self.metrics.evictions += 1
            if not was_used:
                self.metrics.wasted_prefetches += 1
                self.metrics.wasted_prefetch_bytes += nbytes
        slot = self.pool.begin_load(adapter_id, self.pages_of(adapter_id))
        if self.began is not None:
            self.began(slot, adapter_id)
        host = self.host_cache.fetch(adapter_id)
        self.host_cache.hold(adapter_id)
        self.loads[slot] = Load(adapter_id, slot, is_prefetch, host)
        self.load_started[slot] = self.loads[slot].started_at
        self.metrics.loads_started += 1
        if host.done():  # cached on the host: issue the copy now, so this step's schedule may use the slot
            self._issue(self.loads[slot])
        return slot

    def evict(self, adapter_id: str) -> bool:
        """Drop an unpinned, ready adapter from its slot (unregistration). False if it is busy."""
        slot = self.pool.lookup(adapter_id)
        if slot is None:
            return True
        if not self.pool.can_evict(slot):
            return False
        self.pool.evict(slot)
        self._slot_nbytes.pop(slot, None)
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
            host = load.host.result()  # the read's own result: its pages are held for this load
            self.host_cache.adopt(load.adapter_id)
        except Exception as e:  # the adapter's files vanished or changed: fail it alone
            del self.loads[load.slot]
            self.pool.fail_load(load.slot)
            self.host_cache.release(load.adapter_id)
            self.host_cache.discard(load.adapter_id)
            self.failures[load.adapter_id] = e
            self.metrics.load_failures += 1
            return
        self._slot_nbytes[load.slot] = host.nbytes
        load.transfer = self.copier.start(load.slot, self.pool.slots[load.slot].pages, host)

    def _finish(self, load: Load) -> None:
        del self.loads[load.slot]
        self.pool.finish_load(load.slot)
        self.host_cache.release(load.adapter_id)
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
        if self._wait_read(load, timeout_s) and self.loads.get(slot) is load and load.transfer is None:
            self._issue(load)  # errors surface here

    def _wait_read(self, load: Load, timeout_s: float | None) -> bool:
        """Wait until the load's disk read is done; False on timeout. A read deferred for lack of host pages
        waits for the loads and reads that hold them, which finish on their own."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            self.host_cache.start_deferred()
            if not self.host_cache.is_deferred(load.adapter_id):
                try:
                    load.host.exception(timeout=left)
                    return True
                except FutureTimeout:
                    return False
            if left == 0.0:
                return False
            self._progress(left)

    def _progress(self, timeout_s: float | None) -> None:
        """Block until some load or read in flight moves (or timeout_s passes), then poll."""
        reads = [load.host for load in self.loads.values()
                 if load.transfer is None and not self.host_cache.is_deferred(load.adapter_id)]
        transfers = [load.transfer for load in self.loads.values() if load.transfer is not None]
        if reads:
            wait(reads, timeout=timeout_s, return_when=FIRST_COMPLETED)
        elif transfers:
            for transfer in transfers:
                transfer.wait()
        elif others := self.host_cache.running_reads():
            wait(others, timeout=timeout_s, return_when=FIRST_COMPLETED)
        self.poll()

    def wait_any(self, timeout_s: float | None) -> None:
        """Block until some load in flight makes progress, or timeout_s passes."""
        self.host_cache.start_deferred()
        self._progress(timeout_s)

    def before_forward(self, slots) -> None:
        """Order the forward after in-flight copies into the slots it reads."""
        for slot in slots:
            load = self.loads.get(slot)
            if load is not None and load.transfer is not None:
                load.transfer.make_compute_wait()

    def after_forward(self, slots) -> None:
        self.copier.mark_used(slots, [p for slot in slots for p in self.pool.slots[slot].pages])

    def drain(self) -> None:
        """Wait for every load to settle (tests and shutdown)."""
        while self.loads:
            for load in list(self.loads.values()):
                if self.loads.get(load.slot) is not load:
                    continue
                if load.transfer is None:
                    self.wait_usable(load.slot)
                else:
                    load.transfer.wait()
            self.poll()

    def check_invariants(self) -> None:
        for slot, load in self.loads.items():
            s = self.pool.slots[slot]
            assert s.state is SlotState.LOADING and s.adapter_id == load.adapter_id, f"load {load} vs slot {s}"
        for i in self.pool.occupied():
            if self.pool.slots[i].state is SlotState.LOADING:
                assert i in self.loads, f"slot {i} loading with no load in flight"
