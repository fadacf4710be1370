"""Disk -> host tier: packed adapters in pages of one host arena (pinned on CUDA), LRU within it."""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from prefetch.arena import HostArena
from prefetch.threads import one_cpu_thread

# read_fn(adapter_id, page views) packs the adapter into the views; returns (scales [n_modules], rank).
ReadFn = Callable[[str, Sequence[torch.Tensor]], tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class HostAdapter:
    adapter_id: str
    pages: tuple[int, ...]  # arena pages, in rank order
    views: tuple[torch.Tensor, ...]  # [page_numel] each: the arena's memory, pinned on CUDA
    scales: torch.Tensor  # [n_modules] float32
    read_seconds: float  # disk read + pack
    rank: int  # the adapter's largest rank
    page_nbytes: int

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.page_nbytes


class HostCache:
    """LRU of HostAdapters in a HostArena. Disk reads run in a thread pool; all bookkeeping is the
    engine thread's.

    A read reserves its pages when it starts (the worker packs straight into them) and enters the LRU
    when the owner first asks for it, so worker threads never touch shared state. Entries that a load
    holds (`hold` / `release`) are never evicted: their pages may be under a device copy. A read that
    finds no room waits (deferred) until pages come free; `start_deferred` retries it.
    """

    def __init__(self, arena: HostArena, read_fn: ReadFn, pages_of: Callable[[str], int], workers: int = 2):
        self.arena = arena
        self._read_fn, self._pages_of = read_fn, pages_of
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-read",
                                            initializer=one_cpu_thread)
        self._entries: OrderedDict[str, HostAdapter] = OrderedDict()
        self._reads: dict[str, Future[HostAdapter]] = {}  # started or deferred
        self._reading: dict[str, tuple[int, ...]] = {}  # started reads -> their pages
        self._deferred: OrderedDict[str, None] = OrderedDict()  # reads waiting for pages, first come first served
        self._abandoned: list[tuple[Future, tuple[int, ...]]] = []  # discarded while a worker still writes
        self._holds: Counter[str] = Counter()
        self._orphans: dict[str, tuple[int, ...]] = {}  # discarded while held: freed on release
        self.stats = {"hits": 0, "reads": 0, "read_bytes": 0, "read_seconds": 0.0, "evictions": 0}

    @property
    def budget_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def bytes_used(self) -> int:
        """Bytes of arena pages in use: cached entries and reads in flight."""
        return self.arena.used_bytes()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def has(self, adapter_id: str) -> bool:
        """Cached, or being read (or waiting to be)."""
        return adapter_id in self._entries or adapter_id in self._reads

    def is_deferred(self, adapter_id: str) -> bool:
        return adapter_id in self._deferred

    def pending_reads(self) -> int:
        return sum(not f.done() for f in self._reads.values())

    def running_reads(self) -> list[Future]:
        """Reads whose workers hold arena pages (abandoned ones included)."""
        return [self._reads[a] for a in self._reading] + [future for future, _ in self._abandoned]

    # --- reads ----------------------------------------------------------------------------------

    def fetch(self, adapter_id: str, may_defer: bool = True, keep: frozenset = frozenset()) -> Future[HostAdapter] | None:
        """Start (or join) the read of adapter_id; its result also enters the LRU. With no room and
        may_defer=False, returns None and starts nothing. keep: entries this read must not evict."""
        entry = self._entries.get(adapter_id)
        if entry is not None:
            self._entries.move_to_end(adapter_id)
            self.stats["hits"] += 1
            done: Future[HostAdapter] = Future()
            done.set_result(entry)
            return done
        future = self._reads.get(adapter_id)
        if future is not None:
            return future
        future = Future()
        self._reads[adapter_id] = future
        if not self._start(adapter_id, keep):
            if not may_defer:
                del self._reads[adapter_id]
                return None
            self._deferred[adapter_id] = None
        return future

    def _start(self, adapter_id: str, keep: frozenset = frozenset()) -> bool:
        future = self._reads[adapter_id]
        try:
            need = self._pages_of(adapter_id)
        except Exception as e:  # e.g. unregistered meanwhile
            future.set_exception(e)
            return True
        if not self._make_room(need, keep):
            return False
        pages = self.arena.alloc(need)
        self._reading[adapter_id] = pages
        self._executor.submit(self._run_read, adapter_id, pages, future)
        return True

    def _run_read(self, adapter_id: str, pages: tuple[int, ...], future: Future) -> None:
        """Worker thread: pack into the reserved pages; touches nothing but the future and the pages."""
        start = time.perf_counter()
        try:
            views = tuple(self.arena.views(pages))
            scales, rank = self._read_fn(adapter_id, views)
            future.set_result(HostAdapter(adapter_id, pages, views, scales, time.perf_counter() - start, rank,
                                          self.arena.page_nbytes))
        except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the read
            future.set_exception(e)

    def _make_room(self, need: int, keep: frozenset = frozenset()) -> bool:
        """Evict unheld entries not in `keep`, least recently used first, until `need` pages are free."""
        while not self.arena.can_alloc(need):
            victim = next((a for a in self._entries if not self._holds[a] and a not in keep), None)
            if victim is None:
                return False
            self.arena.free(self._entries.pop(victim).pages)
            self.stats["evictions"] += 1
        return True

    def start_deferred(self) -> None:
        """Start deferred reads, first come first served, while there is room."""
        for adapter_id in list(self._deferred):
            if not self._start(adapter_id):
                return
            del self._deferred[adapter_id]

    def absorb_finished(self, waited_on: set[str] = frozenset()) -> None:
        """Move finished warming reads (ones no load waits on) into the LRU; drop failed ones, so a
        later load reads the adapter again and reports why. Then start deferred reads."""
        for adapter_id in [a for a in self._reading if self._reads[a].done() and a not in waited_on]:
            if self._reads[adapter_id].exception() is None:
                self.collect(adapter_id)
            else:
                del self._reads[adapter_id]
                self.arena.free(self._reading.pop(adapter_id))
        for future, pages in [item for item in self._abandoned if item[0].done()]:
            self._abandoned.remove((future, pages))
            self.arena.free(pages)
        self.start_deferred()

    def adopt(self, adapter_id: str) -> None:
        """A load took this adapter's read: keep the result in the LRU as most recently used."""
        if adapter_id in self._reading:
            self.collect(adapter_id)
        elif adapter_id in self._entries:
            self._entries.move_to_end(adapter_id)

    def collect(self, adapter_id: str) -> HostAdapter:
        """Result of a finished read (raises its error); moves it into the LRU. Call only when done."""
        if adapter_id not in self._reading:
            entry = self._entries[adapter_id]
            self._entries.move_to_end(adapter_id)
            return entry
        future = self._reads.pop(adapter_id)
        pages = self._reading.pop(adapter_id)
        if future.exception() is not None:
            self.arena.free(pages)
            raise future.exception()
        host = future.result()
        self.stats["reads"] += 1
        self.stats["read_bytes"] += host.nbytes
        self.stats["read_seconds"] += host.read_seconds
        self._entries[adapter_id] = host
        return host

    # --- holds and removal ----------------------------------------------------------------------

    def hold(self, adapter_id: str) -> None:
        """A load will copy from this adapter's pages: keep them until `release`."""
        self._holds[adapter_id] += 1

    def held(self, adapter_id: str) -> int:
        return self._holds.get(adapter_id, 0)

    def release(self, adapter_id: str) -> None:
        assert self._holds[adapter_id] > 0, f"release of unheld {adapter_id}"
        self._holds[adapter_id] -= 1
        if not self._holds[adapter_id]:
            del self._holds[adapter_id]
            if adapter_id in self._orphans:
                self.arena.free(self._orphans.pop(adapter_id))

    def discard(self, adapter_id: str) -> None:
        """Forget adapter_id (unregistered, or its files changed). A read in flight is abandoned; its
        pages, or a held entry's, are freed once nothing writes or reads them."""
        future = self._reads.pop(adapter_id, None)
        if adapter_id in self._deferred:
            del self._deferred[adapter_id]
            future.set_exception(KeyError(f"{adapter_id} was discarded"))
        elif future is not None:
            pages = self._reading.pop(adapter_id)
            if future.done():
                self.arena.free(pages)
            else:
                self._abandoned.append((future, pages))
        entry = self._entries.pop(adapter_id, None)
        if entry is not None:
            if self._holds[adapter_id]:
                self._orphans[adapter_id] = entry.pages
            else:
                self.arena.free(entry.pages)

    def check_invariants(self) -> None:
        owned = [p for e in self._entries.values() for p in e.pages]
        owned += [p for pages in self._reading.values() for p in pages]
        owned += [p for _, pages in self._abandoned for p in pages]
        owned += [p for pages in self._orphans.values() for p in pages]
        self.arena.pages.check_invariants(owned)
        assert self.bytes_used == len(owned) * self.arena.page_nbytes, "host cache byte count drifted"
        assert not (set(self._reads) & set(self._entries)), "adapter both cached and being read"
        assert set(self._reads) == set(self._reading) | set(self._deferred), "a read is neither started nor deferred"
        assert not (set(self._reading) & set(self._deferred)), "a read is both started and deferred"

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.arena.close()
