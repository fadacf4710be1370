"""Host -> device slot copies, off the critical path.

CUDA: a dedicated copy stream, one pinned H2D copy into a staging buffer, then a multi-tensor
device scatter into the slot, with an event per load. The compute stream waits on that event
(`wait_event`), so nothing on the forward path synchronizes the host.
CPU: the same interface on a worker thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch

from prefetch.host_cache import HostAdapter

# write_slot(slot, flat, scales, rank) scatters a packed adapter (device or host memory) into a slot.
WriteSlot = Callable[[int, torch.Tensor, torch.Tensor, int], None]


class Transfer(Protocol):
    nbytes: int

    def is_done(self) -> bool: ...

    def make_compute_wait(self) -> None: ...

    def wait(self) -> None: ...

    def h2d_seconds(self) -> float: ...


class CudaTransfer:
    def __init__(self, host: HostAdapter, start: torch.cuda.Event, copied: torch.cuda.Event, done: torch.cuda.Event):
        self._host = host  # keeps the pinned source alive until the copy has run
        self._start, self._copied, self.done_event = start, copied, done
        self.nbytes = host.nbytes
        self.issued_at = time.perf_counter()

    def is_done(self) -> bool:
        return self.done_event.query()

    def make_compute_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done_event)

    def wait(self) -> None:
        self.done_event.synchronize()

    def h2d_seconds(self) -> float:
        return self._start.elapsed_time(self._copied) / 1e3


class CudaCopier:
    def __init__(self, device: torch.device, write_slot: WriteSlot, num_slots: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._write_slot = write_slot
        self._last_use: list[torch.cuda.Event | None] = [None] * num_slots

    def start(self, slot: int, host: HostAdapter) -> CudaTransfer:
        start, copied, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        last_use = self._last_use[slot]
        with torch.cuda.stream(self.stream):
            if last_use is not None:
                # The slot may still be read by a forward pass queued before it was unpinned.
                self.stream.wait_event(last_use)
            staging = torch.empty_like(host.flat, device=self.device)
            start.record()
            staging.copy_(host.flat, non_blocking=True)
            copied.record()
            self._write_slot(slot, staging, host.scales.to(self.device, non_blocking=True), host.rank)
            done.record()
        return CudaTransfer(host, start, copied, done)

    def mark_used(self, slots) -> None:
        """Record that the forward just queued on the compute stream reads these slots."""
        event = torch.cuda.Event()
        event.record()
        for slot in slots:
            self._last_use[slot] = event

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

    def __init__(self, write_slot: WriteSlot, num_slots: int):
        self._write_slot = write_slot
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slot-copy")

    def start(self, slot: int, host: HostAdapter) -> ThreadTransfer:
        def copy() -> float:
            begin = time.perf_counter()
            self._write_slot(slot, host.flat, host.scales, host.rank)
            return time.perf_counter() - begin

        return ThreadTransfer(self._executor.submit(copy), host.nbytes)

    def mark_used(self, slots) -> None:
        pass  # CPU forwards finish before the engine thread moves on

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def make_copier(device: torch.device, write_slot: WriteSlot, num_slots: int):
    if device.type == "cuda":
        return CudaCopier(device, write_slot, num_slots)
    return ThreadCopier(write_slot, num_slots)
