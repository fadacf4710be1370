"""Worker threads that take urgent work first: the ranged GETs of remote adapters, where a part that a request
at the replica waits for must not queue behind parts fetched ahead for requests still far back in the router.

Written by hand: concurrent.futures' executors take work strictly in the order it came, and no maintained pool
lets queued work move ahead when it becomes urgent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class UrgentFirstPool:
    """Up to `workers` threads, started as work first comes; each takes the oldest queued job whose `is_urgent()`
    holds when the thread comes free, else the oldest job. Urgency is asked again at every pick, so queued work
    that a request comes to wait for moves ahead of the rest."""

    def __init__(self, workers: int, name: str):
        self._jobs: list[tuple[Callable[[], bool], Future, Callable, tuple]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._workers, self._name, self._started = workers, name, 0

    def submit(self, is_urgent: Callable[[], bool], fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._jobs.append((is_urgent, future, fn, args))
            self._ready.notify()
            if self._started < self._workers:
                threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True).start()
                self._started += 1
        return future

    def shutdown(self) -> None:
        """Cancels the queued jobs; running ones finish."""
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
                pick = next((i for i, job in enumerate(self._jobs) if job[0]()), 0)
                _, future, fn, args = self._jobs.pop(pick)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
