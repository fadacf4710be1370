"""Host -> device page copies, off the critical path.

CUDA: a dedicated copy stream copies each of the adapter's pinned host pages straight into its device
pages, then writes its page table row, rank and scales, with an event per load. The compute stream
waits on that event (`wait_event`), so nothing on the forward path synchronizes the host.
CPU: the same interface on a worker thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

import torch

from prefetch.host_cache import HostAdapter
from prefetch.threads import one_cpu_thread

# write_slot(slot, device pages, host page views, scales, rank) writes a packed adapter into its pages
# and the slot's side tables.
WriteSlot = Callable[[int, Sequence[int], Sequence[torch.Tensor], torch.Tensor, int], None]


class Transfer(Protocol):
    nbytes: int

    def is_done(self) -> bool: ...

    def make_compute_wait(self) -> None: ...

    def wait(self) -> None: ...

    def h2d_seconds(self) -> float: ...


class CudaTransfer:
    def __init__(self, nbytes: int, start: torch.cuda.Event, done: torch.cuda.Event):
        self._start, self.done_event = start, done
        self.nbytes = nbytes
        self.issued_at = time.perf_counter()

    def is_done(self) -> bool:
        return self.done_event.query()

    def make_compute_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done_event)

    def wait(self) -> None:
        self.done_event.synchronize()

    def h2d_seconds(self) -> float:
        return self._start.elapsed_time(self.done_event) / 1e3


class CudaCopier:
    def __init__(self, device: torch.device, write_slot: WriteSlot):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._write_slot = write_slot
        # The last forward that read each slot's side tables, and each page: a load must not overwrite
        # them before it has run (pages move between slots as adapters come and go).
        self._slot_last_use: dict[int, torch.cuda.Event] = {}
        self._page_last_use: dict[int, torch.cuda.Event] = {}

    def start(self, slot: int, pages: Sequence[int], host: HostAdapter) -> CudaTransfer:
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        users = {self._slot_last_use.get(slot)} | {self._page_last_use.get(p) for p in pages}
        with torch.cuda.stream(self.stream):
            for event in users - {None}:
                # The slot or a page may still be read by a forward queued before it was unpinned.
                self.stream.wait_event(event)
            start.record()
            self._write_slot(slot, pages, host.views, host.scales.to(self.device, non_blocking=True), host.rank)
            done.record()
        return CudaTransfer(host.nbytes, start, done)

    def mark_used(self, slots, pages) -> None:
        """Record that the forward just queued on the compute stream reads these slots and pages."""
        event = torch.cuda.Event()
        event.record()
        for slot in slots:
            self._slot_last_use[slot] = event
        for page in pages:
            self._page_last_use[page] = event

    def shutdown(self) -> None:
        self.stream.synchronize()


class ThreadTransfer:
    def __init__(self, future: Future, nbytes: int):
        self._future, self.nbytes = future, nbytes

    def is_done(self) -> bool:
        return self._future.done()

    def make_compute_wait(self) -> None:
        self._future.result()

    wait = make_compute_wait

    def h2d_seconds(self) -> float:
        return self._future.result()


class ThreadCopier:
    """CPU stand-in: the copy runs on a worker thread, completion is a future."""

    def __init__(self, write_slot: WriteSlot):
        self._write_slot = write_slot
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slot-copy", initializer=one_cpu_thread)

    def start(self, slot: int, pages: Sequence[int], host: HostAdapter) -> ThreadTransfer:
        def copy() -> float:
            begin = time.perf_counter()
            self._write_slot(slot, pages, host.views, host.scales, host.rank)
            return time.perf_counter() - begin

        return ThreadTransfer(self._executor.submit(copy), host.nbytes)

    def mark_used(self, slots, pages) -> None:
        pass  # CPU forwards finish before the engine thread moves on

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def make_copier(device: torch.device, write_slot: WriteSlot):
    if device.type == "cuda":
        return CudaCopier(device, write_slot)
    return ThreadCopier(write_slot)
