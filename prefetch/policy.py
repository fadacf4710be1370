"""Hint policy: which adapters to load into which slots. A pure function that returns a plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from prefetch.slot_pool import SlotPool, SlotState


@dataclass(frozen=True)
class SlotView:
    slot: int
    adapter_id: str | None
    state: SlotState
    is_pinned: bool
    last_used: int


@dataclass(frozen=True)
class Plan:
    loads: tuple[tuple[str, int], ...] = ()  # (adapter_id, slot); the slot's old adapter is evicted

    def __bool__(self) -> bool:
        return bool(self.loads)


def view_of(pool: SlotPool) -> list[SlotView]:
    return [SlotView(i, s.adapter_id, s.state, s.pins > 0, s.last_used) for i, s in enumerate(pool.slots)]


def plan(slots: Sequence[SlotView], demand: Sequence[str], max_loads: int) -> Plan:
    """Plan loads for the first adapters in `demand` (highest priority first) that are not resident.

    Only as many distinct adapters as there are slots are considered: more cannot be resident at once.
    Victims, in order: free slots; then ready, unpinned slots whose adapter nobody demands, least
    recently used first; then ready, unpinned slots holding a demanded adapter of lower priority.
    """
    if max_loads <= 0:
        return Plan()
    priority: dict[str, int] = {}
    for adapter_id in demand:
        priority.setdefault(adapter_id, len(priority))
        if len(priority) == len(slots):
            break
    resident = {v.adapter_id for v in slots if v.adapter_id is not None}
    wanted = [a for a in priority if a not in resident]
    if not wanted:
        return Plan()

    free = [v for v in slots if v.state is SlotState.FREE]
    evictable = [v for v in slots if v.state is SlotState.READY and not v.is_pinned]
    idle = sorted((v for v in evictable if v.adapter_id not in priority), key=lambda v: v.last_used)
    # Lowest priority (largest index) first, so a hot adapter is the last to go.
    demanded = sorted(
        (v for v in evictable if v.adapter_id in priority), key=lambda v: (-priority[v.adapter_id], v.last_used)
    )
    loads = []
    for adapter_id in wanted[:max_loads]:
        if free:
            victim = free.pop(0)
        elif idle:
            victim = idle.pop(0)
        elif demanded and priority[demanded[0].adapter_id] > priority[adapter_id]:
            victim = demanded.pop(0)
        else:
            break
        loads.append((adapter_id, victim.slot))
    return Plan(tuple(loads))
