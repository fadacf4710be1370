"""Residency of adapters for one engine: host cache + slot pool + prefetch pipeline, one facade.

All methods run on the engine thread, which owns this object.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import torch

from prefetch.arena import HostArena
from prefetch.copier import WriteSlot, make_copier
from prefetch.host_cache import HostCache
from prefetch.layout import PageLayout
from prefetch.metrics import PrefetchMetrics
from prefetch.pipeline import PrefetchPipeline
from prefetch.policy import plan, view_of
from prefetch.slot_pool import SlotPool, SlotState

# Validated weights are finite, but a huge finite value could still overflow x @ A to inf in a slot
# that other rows multiply by zero (inf * 0 = NaN). No trained adapter comes near this bound.
MAX_ABS_WEIGHT = 1e6
DOWNLOAD_POLL_S = 0.005  # how often a stalled engine looks again at an adapter still downloading to the node


class Residency:
    def __init__(self, config, layout: PageLayout, pool: SlotPool, write_slot: WriteSlot,
                 read_parts: Callable[[str], Mapping], rank_of: Callable[[str], int], device: torch.device,
                 dtype: torch.dtype, fetch_ahead: Callable[[list[str], frozenset[str]], int] | None = None,
                 on_node: Callable[[str], bool] | None = None, is_fetching: Callable[[str], bool] | None = None,
                 began: Callable[[int, str], None] | None = None):
        """write_slot: copies a packed adapter into its device pages (LoRASlots.write_slot); runs on the copier.
        read_parts(adapter_id) -> what PageLayout.pack takes; called on disk worker threads.
        rank_of(adapter_id) -> its registered (largest) rank, which sets the pages it needs.
        fetch_ahead(adapter_ids, urgent), on_node(adapter_id), is_fetching(adapter_id): the node cache of remote
        adapters (AdapterRegistry): start fetches, nearest need first (urgent: those of requests queued here),
        whether an adapter's files are on this node, and whether a fetch of them is under way.
        began(slot, adapter_id): a load into `slot` began, on the engine thread (a tensor-parallel engine's workers
        start theirs)."""
        self._fetch_ahead, self._on_node, self._is_fetching = fetch_ahead, on_node, is_fetching
        self.layout, self.pool = layout, pool
        self.device, self.dtype = device, dtype
        self._read_parts, self._rank_of = read_parts, rank_of
        self.metrics = PrefetchMetrics()
        arena = HostArena.for_budget(config.host_cache_bytes, layout.page_numel, dtype, pin=device.type == "cuda",
                                     min_pages=layout.max_pages)
        self.host_cache = HostCache(arena, self._read, self.pages_of, workers=config.disk_workers)
        self.pipeline = PrefetchPipeline(pool, self.host_cache, make_copier(device, write_slot), self.metrics,
                                         self.pages_of, config.max_inflight_loads, began)
        self.draining: int | None = None  # a pinned slot that takes no new requests, so it can be reused

    def pages_of(self, adapter_id: str) -> int:
        return self.layout.pages_for(self._rank_of(adapter_id))

    def free_slots(self) -> int:
        """Adapters at max_rank that could load now without an eviction."""
        return min(self.pool.free_count(), self.pool.free_page_count() // self.layout.max_pages)

    def host_capacity(self) -> int:
        """Adapters at max_rank that the host cache holds."""
        return self.host_cache.arena.num_pages // self.layout.max_pages

    def _read(self, adapter_id: str, pages) -> tuple[torch.Tensor, int]:
        """Disk -> the reserved host pages (worker thread). A handful of torch calls, each a GIL handoff that
        can wait behind the engine thread, so no per-module work happens here (see AdapterFile)."""
        parts = self._read_parts(adapter_id)
        scales = self.layout.pack(parts, pages)
        for page in pages:
            low, high = (value.item() for value in torch.aminmax(page))
            if not -MAX_ABS_WEIGHT <= low <= high <= MAX_ABS_WEIGHT:  # also false for NaN and overflowed casts
                raise ValueError(f"weights reach [{low:g}, {high:g}] in {self.dtype}; the limit is ±{MAX_ABS_WEIGHT:g}")
        return scales, max((part[2] for part in parts.values()), default=0)

    # --- per step -------------------------------------------------------------------------------

    def classify_arrival(self, adapter_id: str, hinted: bool = False) -> None:
        """hinted: the request waited in the router, which hinted its adapter here."""
        state = self.pool.state_of(adapter_id)
        if state is SlotState.READY:
            self.metrics.hint_hits += 1
        elif state is SlotState.LOADING:
            self.metrics.inflight_hits += 1
        else:
            self.metrics.misses += 1
        if hinted:
            if state in (SlotState.READY, SlotState.LOADING):
                self.metrics.hinted_on_device += 1
            elif self.host_cache.has(adapter_id):
                self.metrics.hinted_in_host += 1
            elif self._on_node is not None and not self._on_node(adapter_id):
                self.metrics.hinted_from_store += 1
            else:
                self.metrics.hinted_from_disk += 1

    def poll(self) -> None:
        self.pipeline.poll()
        if self.draining is not None and self.pool.slots[self.draining].pins == 0:
            self.draining = None

    def prefetch(self, queued: list[str], hinted: list[str] = (), incoming: frozenset = frozenset(),
                 ahead: list[str] = ()) -> None:
        """queued: one adapter per request queued here; hinted: per request waiting near the router's front for
        here; ahead: per request hinted far back in the router's queue.

        Remote adapters not yet on this node are fetched to its disk cache first, for hints as for queued
        requests, nearest first; a hinted one enters the host and device tiers only once its files are on the
        node, so that a host read worker and arena pages never wait on the network for a request that has not
        arrived, and an `ahead` one not before its request nears the front (downloads finish out of order, and
        an adapter loaded for a request far back would often be evicted unused).
        A queued request's adapter whose fetch is under way is loaded once the fetch ends, not before: a load's
        host read would hold a read worker and its arena pages for the whole download, and reads of adapters
        already on the node would queue behind it."""
        if self._fetch_ahead is not None:
            self._fetch_ahead([*queued, *hinted, *ahead], frozenset(queued))
            queued = [adapter_id for adapter_id in queued if not self._is_downloading(adapter_id)]
            hinted = [adapter_id for adapter_id in hinted if self._on_node(adapter_id)]
        self.pipeline.prefetch([*queued, *hinted], incoming, hinted_from=len(queued))

    def _is_downloading(self, adapter_id: str) -> bool:
        return self._is_fetching is not None and self._is_fetching(adapter_id)

    def is_loading(self) -> bool:
        return bool(self.pipeline.loads)

    def acquire(self, adapter_id: str, may_block: bool, steps_left: Callable[[int], int]) -> int | None:
        """Pin the slot of adapter_id if a forward may use it now; None defers the request.

        may_block: load synchronously if needed (prefetch disabled); the wait counts as a stall.
        steps_left(slot) -> how many more steps the requests pinning `slot` may run (the caller's batch knows):
        with every slot pinned, the one that frees soonest drains.
        """
        slot = self.pool.lookup(adapter_id)
        if slot is None and may_block:
            slot = self._load_now(adapter_id)
        if slot is None:
            if self._planned_load(adapter_id) is None and self.draining is None:
                self._start_draining(steps_left)
            return None
        if slot == self.draining or not self.pipeline.is_usable(slot):
            return None
        self.pool.pin(slot)
        return slot

    def load_started_at(self, slot: int) -> float | None:
        """When the latest load into `slot` began (time.perf_counter), if it ever had one."""
        return self.pipeline.load_started.get(slot)

    def release(self, slot: int) -> None:
        self.pool.unpin(slot)
        if slot == self.draining and self.pool.slots[slot].pins == 0:
            self.draining = None

    def _planned_load(self, adapter_id: str) -> tuple[int, ...] | None:
        """The victims a load of adapter_id needs now (ignoring what others want), or None if it cannot start."""
        loads = plan(view_of(self.pool), [adapter_id], self.pipeline.page_needs([adapter_id]), max_loads=1).loads
        return loads[0][1] if loads else None

    def _start_draining(self, steps_left: Callable[[int], int]) -> None:
        """Every slot is pinned: stop feeding the one that frees soonest (fewest steps left to its requests,
        then least recently used), so a waiting adapter gets in. Draining the least recently used slot
        alone would let a waiting request sit behind a long generation."""
        pinned = [i for i in self.pool.occupied() if self.pool.slots[i].pins > 0]
        if pinned:
            self.draining = min(pinned, key=lambda i: (steps_left(i), self.pool.slots[i].last_used))

    def _load_now(self, adapter_id: str) -> int | None:
        victims = self._planned_load(adapter_id)
        if victims is None:
            return None
        start = time.perf_counter()
        slot = self.pipeline.start_load(adapter_id, victims, is_prefetch=False)
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
            if self._is_downloading(adapter_id):  # its load starts once the bytes are on the node (see prefetch)
                time.sleep(DOWNLOAD_POLL_S if timeout_s is None else min(timeout_s, DOWNLOAD_POLL_S))
                return
            victims = self._planned_load(adapter_id)
            if victims is None:  # every slot is mid-load or pinned: wait for one to settle
                self.pipeline.wait_any(timeout_s)
                return
            self.pipeline.start_load(adapter_id, victims, is_prefetch=False)
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
        for load in self.pipeline.loads.values():
            assert self.host_cache.held(load.adapter_id) == 1, f"load of {load.adapter_id} does not hold its host pages"
        if self.draining is not None:
            assert self.pool.slots[self.draining].pins > 0, "draining an unpinned slot"

    def snapshot(self) -> dict:
        states = [self.pool.slots[i].state for i in self.pool.occupied()]
        return {
            **self.metrics.snapshot(self.host_cache.stats),
            "slots_total": len(self.pool),
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.free_page_count(),
            "page_rows": self.layout.page_rows,
            "slots_ready": states.count(SlotState.READY),
            "slots_loading": states.count(SlotState.LOADING),
            "slots_pinned": self.pool.pinned_count(),
            "slots": self.pool.snapshot(),
            "host_cache_bytes": self.host_cache.bytes_used,
            "host_arena_bytes": self.host_cache.budget_bytes,
            "host_pinned_bytes": self.host_cache.arena.pinned_bytes,
            "resident_adapters": sorted(a for a, i in self.pool.adapter_to_slot.items()
                                        if self.pool.slots[i].state is SlotState.READY),
            "loading_adapters": sorted(load.adapter_id for load in self.pipeline.loads.values()),
        }

    def shutdown(self) -> None:
        self.pipeline.copier.shutdown()  # copies read the host arena: finish them before it goes
        self.host_cache.shutdown()
