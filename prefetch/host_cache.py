"""Disk -> host tier: packed adapters in (pinned, when CUDA is present) host memory, LRU under a byte budget."""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class HostAdapter:
    adapter_id: str
    flat: torch.Tensor  # [layout.numel], engine dtype, pinned when CUDA is available
    scales: torch.Tensor  # [n_modules] float32
    read_seconds: float  # disk read + pack
    rank: int = 0  # the adapter's largest rank (0: unknown, treated as the layout's max_rank)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class HostCache:
    """LRU of HostAdapters. Disk reads run in a thread pool; the dict is owned by the engine thread.

    A read's result enters the LRU when the owner first asks for it (`get`), so worker threads never
    touch shared state. Entries are never handed out half-built.
    """

    def __init__(self, budget_bytes: int, read_fn: Callable[[str], HostAdapter], workers: int = 2):
        self.budget_bytes = budget_bytes
        self._read_fn = read_fn
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-read")
        self._entries: OrderedDict[str, HostAdapter] = OrderedDict()
        self._reads: dict[str, Future[HostAdapter]] = {}
        self.bytes_used = 0
        self.stats = {"hits": 0, "reads": 0, "read_bytes": 0, "read_seconds": 0.0, "evictions": 0}

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def has(self, adapter_id: str) -> bool:
        """Cached, or being read."""
        return adapter_id in self._entries or adapter_id in self._reads

    def pending_reads(self) -> int:
        return sum(not f.done() for f in self._reads.values())

    def absorb_finished(self, waited_on: set[str] = frozenset()) -> None:
        """Move finished warming reads (ones no load waits on) into the LRU; drop failed ones, so a
        later load reads the adapter again and reports why."""
        for adapter_id, future in list(self._reads.items()):
            if future.done() and adapter_id not in waited_on:
                if future.exception() is None:
                    self.collect(adapter_id)
                else:
                    del self._reads[adapter_id]

    def adopt(self, adapter_id: str) -> None:
        """A load took this adapter's read: keep the result in the LRU as most recently used."""
        if adapter_id in self._reads:
            self.collect(adapter_id)
        elif adapter_id in self._entries:
            self._entries.move_to_end(adapter_id)

    def fetch(self, adapter_id: str) -> Future[HostAdapter]:
        """Start (or join) the read of adapter_id. The future's result is also kept in the LRU."""
        entry = self._entries.get(adapter_id)
        if entry is not None:
            self._entries.move_to_end(adapter_id)
            self.stats["hits"] += 1
            done: Future[HostAdapter] = Future()
            done.set_result(entry)
            return done
        future = self._reads.get(adapter_id)
        if future is None:
            future = self._executor.submit(self._timed_read, adapter_id)
            self._reads[adapter_id] = future
        return future

    def _timed_read(self, adapter_id: str) -> HostAdapter:
        start = time.perf_counter()
        host = self._read_fn(adapter_id)
        return HostAdapter(host.adapter_id, host.flat, host.scales, time.perf_counter() - start, host.rank)

    def collect(self, adapter_id: str) -> HostAdapter:
        """Result of a finished read (raises its error); moves it into the LRU. Call only when done."""
        future = self._reads.pop(adapter_id, None)
        if future is None:
            entry = self._entries[adapter_id]
            self._entries.move_to_end(adapter_id)
            return entry
        host = future.result()
        self.stats["reads"] += 1
        self.stats["read_bytes"] += host.nbytes
        self.stats["read_seconds"] += host.read_seconds
        self._entries[adapter_id] = host
        self.bytes_used += host.nbytes
        self._shrink(keep=adapter_id)
        return host

    def _shrink(self, keep: str) -> None:
        # The entry just read stays even if it alone exceeds the budget: a load in flight needs it.
        while self.bytes_used > self.budget_bytes and len(self._entries) > 1:
            victim = next(iter(self._entries))
            if victim == keep:
                self._entries.move_to_end(victim)
                victim = next(iter(self._entries))
            self.bytes_used -= self._entries.pop(victim).nbytes
            self.stats["evictions"] += 1

    def discard(self, adapter_id: str) -> None:
        """Forget adapter_id (unregistered, or its files changed). A read in flight is abandoned."""
        self._reads.pop(adapter_id, None)
        entry = self._entries.pop(adapter_id, None)
        if entry is not None:
            self.bytes_used -= entry.nbytes

    def check_invariants(self) -> None:
        assert self.bytes_used == sum(e.nbytes for e in self._entries.values()), "host cache byte count drifted"
        assert not (set(self._reads) & set(self._entries)), "adapter both cached and being read"

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
