"""Which adapter sits in which device slot, and which pages of the adapter pool it owns. Plain Python
bookkeeping; device copies live elsewhere.

A slot is an adapter's entry in the kernels' side tables (its page table row, rank and scales); its
weights live in `pages` of the shared page pool (prefetch/layout.py). Slots and pages are handed out
together: a load takes a free slot and as many free pages as its rank needs, and an eviction returns both.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


@dataclass
class Slot:
    adapter_id: str | None = None
    state: SlotState = SlotState.FREE
    pins: int = 0  # running requests that read this slot; a pinned slot is never overwritten
    last_used: int = 0  # logical clock of the last pin or load, for LRU
    used_since_load: bool = False  # a load evicted before any use is a wasted prefetch
    pages: tuple[int, ...] = ()  # pool pages holding the adapter's rank rows, in rank order


class PageAllocator:
    """Free list of fixed-size pages: any free pages serve any request, so there is no fragmentation."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a min-heap: low pages first, so tests can predict them

    def free_count(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> tuple[int, ...]:
        assert self.can_alloc(n), f"{n} pages wanted, {len(self._free)} free"
        return tuple(heapq.heappop(self._free) for _ in range(n))

    def free(self, pages) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def check_invariants(self, used) -> None:
        """used: every allocated page, each once."""
        used = list(used)
        assert len(set(used)) == len(used), f"a page is allocated twice: {sorted(used)}"
        assert set(used).isdisjoint(self._free), "a page is both free and allocated"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert len(used) + len(self._free) == self.num_pages, (
            f"{len(used)} allocated + {len(self._free)} free != {self.num_pages} pages")


class SlotPool:
    """Slots with states free -> loading -> ready -> (evicted) free, over `num_pages` pool pages.

    `max_slots` bounds how many adapters may be resident at once (default: one per page). Checks and
    actions come in pairs (`can_begin_load` / `begin_load`); actions assert their check.
    """

    def __init__(self, num_pages: int, max_slots: int | None = None):
        max_slots = num_pages if max_slots is None else max_slots
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.pages = PageAllocator(num_pages)
        self.slots = [Slot() for _ in range(max_slots)]
        self.adapter_to_slot: dict[str, int] = {}
        self._free_slots = list(range(max_slots))  # min-heap
        self._clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, adapter_id: str) -> int | None:
        return self.adapter_to_slot.get(adapter_id)

    def state_of(self, adapter_id: str) -> SlotState | None:
        slot = self.adapter_to_slot.get(adapter_id)
        return None if slot is None else self.slots[slot].state

    def occupied(self) -> list[int]:
        """Slots that hold an adapter (loading or ready)."""
        return sorted(self.adapter_to_slot.values())

    def can_begin_load(self, num_pages: int) -> bool:
        return bool(self._free_slots) and self.pages.can_alloc(num_pages)

    def begin_load(self, adapter_id: str, num_pages: int) -> int:
        """Start loading adapter_id into a free slot and `num_pages` free pages; returns the slot."""
        assert self.can_begin_load(num_pages), (f"{num_pages} pages wanted, {self.pages.free_count()} free, "
                                                f"{len(self._free_slots)} free slots")
        assert adapter_id not in self.adapter_to_slot, f"{adapter_id} already in slot {self.adapter_to_slot[adapter_id]}"
        slot = heapq.heappop(self._free_slots)
        s = self.slots[slot]
        s.adapter_id, s.state, s.last_used, s.used_since_load = adapter_id, SlotState.LOADING, self._tick(), False
        s.pages = self.pages.alloc(num_pages)
        self.adapter_to_slot[adapter_id] = slot
        return slot

    def finish_load(self, slot: int) -> None:
        assert self.slots[slot].state is SlotState.LOADING
        self.slots[slot].state = SlotState.READY

    def fail_load(self, slot: int) -> None:
        s = self.slots[slot]
        assert s.state is SlotState.LOADING and s.pins == 0, f"slot {slot} is {s}"
        self._clear(slot)

    def can_evict(self, slot: int) -> bool:
        s = self.slots[slot]
        return s.state is SlotState.READY and s.pins == 0

    def evict(self, slot: int) -> tuple[str, bool]:
        """Free an unpinned, ready slot and its pages. Returns (its adapter, whether it was used since loading)."""
        assert self.can_evict(slot), f"slot {slot} is {self.slots[slot]}"
        return self._clear(slot)

    def _clear(self, slot: int) -> tuple[str, bool]:
        s = self.slots[slot]
        evicted, was_used = s.adapter_id, s.used_since_load
        del self.adapter_to_slot[evicted]
        self.pages.free(s.pages)
        heapq.heappush(self._free_slots, slot)
        self.slots[slot] = Slot(last_used=s.last_used)
        return evicted, was_used

    def pin(self, slot: int) -> None:
        s = self.slots[slot]
        assert s.state is not SlotState.FREE, f"pin of free slot {slot}"
        s.pins += 1
        s.used_since_load = True
        s.last_used = self._tick()

    def unpin(self, slot: int) -> None:
        s = self.slots[slot]
        assert s.pins > 0, f"unpin of unpinned slot {slot}"
        s.pins -= 1

    def free_count(self) -> int:
        """Free slots: adapters that could still load without an eviction, pages permitting."""
        return len(self._free_slots)

    def free_page_count(self) -> int:
        return self.pages.free_count()

    def pinned_count(self) -> int:
        return sum(self.slots[i].pins > 0 for i in self.adapter_to_slot.values())

    def check_invariants(self) -> None:
        seen = {}
        for i, s in enumerate(self.slots):
            assert s.pins >= 0, f"slot {i} has negative pins"
            if s.state is SlotState.FREE:
                assert s.adapter_id is None and s.pins == 0 and not s.pages, f"free slot {i} holds {s}"
            else:
                assert s.adapter_id is not None and s.pages, f"slot {i} is {s.state} without an adapter or pages"
                assert s.adapter_id not in seen, f"{s.adapter_id} in slots {seen.get(s.adapter_id)} and {i}"
                seen[s.adapter_id] = i
        assert seen == self.adapter_to_slot, f"adapter_to_slot {self.adapter_to_slot} != slots {seen}"
        free = set(range(len(self.slots))) - set(seen.values())
        assert sorted(self._free_slots) == sorted(free), f"free slots {sorted(self._free_slots)} != {sorted(free)}"
        self.pages.check_invariants(p for s in self.slots for p in s.pages)

    def snapshot(self) -> list[dict]:
        return [
            {"slot": i, "adapter_id": s.adapter_id, "state": s.state.value, "pins": s.pins, "pages": len(s.pages)}
            for i, s in ((i, self.slots[i]) for i in self.occupied())
        ]
