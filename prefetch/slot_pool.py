"""Which adapter sits in which device slot. Plain Python bookkeeping; device copies live elsewhere."""

from __future__ import annotations

import enum
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


class SlotPool:
    """A fixed number of slots with states free -> loading -> ready -> (evicted) free.

    Checks and actions come in pairs (`can_begin_load` / `begin_load`); actions assert their check.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.slots = [Slot() for _ in range(num_slots)]
        self.adapter_to_slot: dict[str, int] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, adapter_id: str) -> int | None:
        return self.adapter_to_slot.get(adapter_id)

    def state_of(self, adapter_id: str) -> SlotState | None:
        slot = self.adapter_to_slot.get(adapter_id)
        return None if slot is None else self.slots[slot].state

    def can_begin_load(self, slot: int) -> bool:
        s = self.slots[slot]
        return s.state is SlotState.FREE or (s.state is SlotState.READY and s.pins == 0)

    def begin_load(self, slot: int, adapter_id: str) -> tuple[str | None, bool]:
        """Start loading adapter_id into slot. Returns (evicted adapter or None, whether it was used)."""
        assert self.can_begin_load(slot), f"slot {slot} is {self.slots[slot]}"
        assert adapter_id not in self.adapter_to_slot, f"{adapter_id} already in slot {self.adapter_to_slot[adapter_id]}"
        evicted, was_used = self._clear(slot)
        s = self.slots[slot]
        s.adapter_id, s.state, s.last_used, s.used_since_load = adapter_id, SlotState.LOADING, self._tick(), False
        self.adapter_to_slot[adapter_id] = slot
        return evicted, was_used

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

    def evict(self, slot: int) -> tuple[str | None, bool]:
        assert self.can_evict(slot), f"slot {slot} is {self.slots[slot]}"
        return self._clear(slot)

    def _clear(self, slot: int) -> tuple[str | None, bool]:
        s = self.slots[slot]
        evicted, was_used = s.adapter_id, s.used_since_load
        if evicted is not None:
            del self.adapter_to_slot[evicted]
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
        return sum(s.state is SlotState.FREE for s in self.slots)

    def pinned_count(self) -> int:
        return sum(s.pins > 0 for s in self.slots)

    def check_invariants(self) -> None:
        seen = {}
        for i, s in enumerate(self.slots):
            assert s.pins >= 0, f"slot {i} has negative pins"
            if s.state is SlotState.FREE:
                assert s.adapter_id is None and s.pins == 0, f"free slot {i} holds {s}"
            else:
                assert s.adapter_id is not None, f"slot {i} is {s.state} without an adapter"
                assert s.adapter_id not in seen, f"{s.adapter_id} in slots {seen.get(s.adapter_id)} and {i}"
                seen[s.adapter_id] = i
        assert seen == self.adapter_to_slot, f"adapter_to_slot {self.adapter_to_slot} != slots {seen}"

    def snapshot(self) -> list[dict]:
        return [
            {"slot": i, "adapter_id": s.adapter_id, "state": s.state.value, "pins": s.pins}
            for i, s in enumerate(self.slots)
        ]
