"""The threads that fetch downloads' ranged parts, and the one record of which adapters requests wait for.

A part of an adapter that a request waits for must not queue behind parts fetched ahead for requests still far
back in the router. Who waits is known in one place, here: a read under way (`waited_for`), or a request queued
at the replica (`set_queued`, from each step's fetches ahead). A thread that comes free takes the oldest part of
an adapter someone waits for, else the oldest part; the record is asked again at every pick, so queued parts
move ahead as soon as a request comes to wait for them.

Written by hand: concurrent.futures' executors take work strictly in the order it came, and no maintained pool
lets queued work move ahead when it becomes urgent.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from contextlib import contextmanager


class PartPool:
    """Up to `workers` threads, started as parts first come. Each part is queued under its adapter's key (its
    URI); `is_waited_for(key)` decides which goes first."""

    def __init__(self, workers: int, name: str):
        self._jobs: list[tuple[str, Future, Callable, tuple]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._workers, self._name, self._started = workers, name, 0
        self._reads: Counter[str] = Counter()  # key -> reads under way that wait for it
        self._queued: frozenset[str] = frozenset()  # keys of the requests queued at the replica

    def is_waited_for(self, key: str) -> bool:
        return key in self._queued or key in self._reads

    @contextmanager
    def waited_for(self, key: str) -> Iterator[None]:
        """A read waits for `key`'s bytes for the block."""
        with self._ready:
            self._reads[key] += 1
        try:
            yield
        finally:
            with self._ready:
                self._reads[key] -= 1
                if not self._reads[key]:
                    del self._reads[key]

    def set_queued(self, keys: Collection[str]) -> None:
        """The keys of the requests queued at the replica now, in place of the last ones named."""
        queued = frozenset(keys)
        if queued != self._queued:
            with self._ready:
                self._queued = queued

    def submit(self, key: str, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._jobs.append((key, future, fn, args))
            self._ready.notify()
            if self._started < self._workers:
                threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
                self._started += 1
        return future

    def shutdown(self) -> None:
        """Cancels the queued parts; running ones finish."""
        with self._ready:
            self._closed = True
            for _, future, _, _ in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._ready.notify_all()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                pick = next((i for i, job in enumerate(self._jobs) if self.is_waited_for(job[0])), 0)
                _, future, fn, args = self._jobs.pop(pick)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
