"""Hint policy: which adapters to load, and which resident ones to evict for them. A pure function that
returns a plan."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from prefetch.slot_pool import SlotPool, SlotState

PROTECT_REQUESTS = 2  # an adapter this many requests want is not evicted for a one-off


@dataclass(frozen=True)
class SlotView:
    slot: int
    adapter_id: str
    state: SlotState
    is_pinned: bool
    last_used: int
    pages: int = 1


@dataclass(frozen=True)
class PoolView:
    free_pages: int
    free_slots: int
    slots: tuple[SlotView, ...]  # occupied slots only
    total_pages: int = 0
    total_slots: int = 0


@dataclass(frozen=True)
class Plan:
    # (adapter_id, slots to evict first): after the evictions the pool has the slot and pages it needs
    loads: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads)


def view_of(pool: SlotPool) -> PoolView:
    slots = tuple(SlotView(i, s.adapter_id, s.state, s.pins > 0, s.last_used, len(s.pages))
                  for i, s in ((i, pool.slots[i]) for i in pool.occupied()))
    return PoolView(pool.free_page_count(), pool.free_count(), slots, pool.num_pages, len(pool))


def plan(pool: PoolView, demand: Sequence[str], pages_of: Mapping[str, int], max_loads: int,
         incoming: frozenset = frozenset()) -> Plan:
    """Plan loads for the first adapters in `demand` (highest priority first) that are not resident.

    `demand` holds one entry per request that wants an adapter (queued here, or waiting in the router and
    hinted to this replica), so an adapter's count is how many requests want it. `incoming`: adapters that
    requests waiting elsewhere are about to bring here. `pages_of[adapter]`: pages its rank needs.

    Only as many distinct adapters as the pool can hold are considered. Victims, in order: free pages and
    slots; then ready, unpinned slots whose adapter nobody wants, least recently used first; then ready,
    unpinned slots holding a wanted adapter of lower priority. An adapter that PROTECT_REQUESTS or more
    requests want, or that is incoming, is never evicted for a one-off (an adapter one request wants).
    A wanted adapter that cannot get room stops the plan: those behind it do not take its place.
    """
    if max_loads <= 0:
        return Plan()
    wants = Counter(demand)
    priority: dict[str, int] = {}
    pages_seen = 0
    for adapter_id in demand:
        if adapter_id in priority or adapter_id not in pages_of:
            continue
        pages_seen += pages_of[adapter_id]
        if len(priority) == pool.total_slots or pages_seen > pool.total_pages:
            break
        priority[adapter_id] = len(priority)
    resident = {v.adapter_id for v in pool.slots}
    wanted = [a for a in priority if a not in resident]
    if not wanted:
        return Plan()

    def is_protected(adapter_id: str) -> bool:
        return wants[adapter_id] >= PROTECT_REQUESTS or adapter_id in incoming

    evictable = [v for v in pool.slots if v.state is SlotState.READY and not v.is_pinned]
    idle = sorted((v for v in evictable if not wants[v.adapter_id] and v.adapter_id not in incoming),
                  key=lambda v: v.last_used)
    unwanted_rank = len(priority)  # incoming adapters nobody here wants yet rank below every wanted one
    # Lowest priority (largest index) first, so a hot adapter is the last to go.
    demanded = sorted((v for v in evictable if v not in idle),
                      key=lambda v: (-priority.get(v.adapter_id, unwanted_rank), v.last_used))
    free_pages, free_slots = pool.free_pages, pool.free_slots
    loads = []
    for adapter_id in wanted[:max_loads]:
        need, rank = pages_of[adapter_id], priority[adapter_id]
        one_off = not is_protected(adapter_id)
        allowed = [v for v in demanded if priority.get(v.adapter_id, unwanted_rank) > rank
                   and not (one_off and is_protected(v.adapter_id))]
        victims, pages, slots = [], free_pages, free_slots
        for v in idle + allowed:
            if pages >= need and slots >= 1:
                break
            victims.append(v)
            pages, slots = pages + v.pages, slots + 1
        if pages < need or slots < 1:
            break
        free_pages, free_slots = pages - need, slots - 1
        idle = [v for v in idle if v not in victims]
        demanded = [v for v in demanded if v not in victims]
        loads.append((adapter_id, tuple(v.slot for v in victims)))
    return Plan(tuple(loads))
