"""The ranged GETs of remote adapters, run in a helper process so that their Python never holds the engine's GIL.

A download's parts go through fsspec (s3fs, aiohttp): an event loop that parses each response and copies its
chunks in Python, at hundreds of MB/s. In the engine's process that work would take the GIL from the engine
thread, which gives the GIL up at every torch call and waits to take it back: a decode step's host part would
run several times its own CPU time while downloads and host reads run beside it. Here each part is one request to a
helper process, which fetches the range and writes it into the destination file itself; the caller's thread
only waits.

The helper is one process per parent and environment (credentials and endpoints come from the environment),
started by RemoteStore.prepare_downloads (a registry with a node cache calls it) or at the first part.
prepare_downloads also has it make its clients for the remote roots then: an S3 client loads botocore's
service model, which would otherwise make the first download slower than the next. It serves
parts on its own threads (`part_worker.py`), as many at once as callers send, and exits when its parent goes
(its request pipe closes). Which part goes next stays with the caller (UrgentFirstPool).

Written by hand: concurrent.futures' and multiprocessing's pools start their workers with multiprocessing, which a
daemonic process (the engine's own process is one) may not do; this one is a plain subprocess with two pipes.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from app.errors import AdapterStoreUnavailable

log = logging.getLogger(__name__)
_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds `app`, for the helper's imports
READY = -1  # the part id of the helper's first message: its imports are done
PREPARED = -2  # the part id of `prepare`'s request and of its answer: the clients for the roots are made


class PartProcess:
    """One helper process and the parts in flight to it. `fetch` blocks its caller until the part is written."""

    def __init__(self):
        requests_read, self._requests_write = os.pipe()
        self._replies_read, replies_write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from app.adapters.part_worker import main; main()", str(requests_read),
             str(replies_write)], pass_fds=(requests_read, replies_write), env=env, stdin=subprocess.DEVNULL)
        os.close(requests_read)
        os.close(replies_write)
        self._requests = Connection(self._requests_write, readable=False)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._ready, self._prepared = threading.Event(), threading.Event()
        self.alive = True
        threading.Thread(target=self._read, name="adapter-part-replies", daemon=True).start()

    def fetch(self, obj, dest: Path, start: int, end: int, roots: tuple[str, ...], timeout_s: float) -> str:
        """Write bytes [start, end) of `obj` into `dest` at `start`, as a store with `roots` and `timeout_s` reads
        them (its redirects stay under `roots`); their digest. Raises what the helper raised."""
        future: Future = Future()
        with self._lock:
            if not self.alive:
                raise AdapterStoreUnavailable("the adapter download process exited")
            part_id = next(self._ids)
            self._pending[part_id] = future
            try:
                self._requests.send_bytes(pickle.dumps((part_id, obj, str(dest), start, end, tuple(roots), timeout_s)))
            except OSError as e:
                self._pending.pop(part_id)
                raise AdapterStoreUnavailable(f"the adapter download process is gone: {e}") from e
        # The store's own timeouts end a part first; this bounds a helper that stopped answering.
        try:
            return future.result(timeout=3 * timeout_s + 30)
        except TimeoutError:
            raise AdapterStoreUnavailable(f"{obj.uri}: the download process did not answer for a part in "
                                          f"{3 * timeout_s + 30:.0f} s") from None

    def prepare(self, roots: tuple[str, ...], timeout_s: float) -> None:
        """Have the helper make its filesystems and clients for `roots` (a store's, with its `timeout_s`) now,
        instead of at the first part; returns at once. A root it cannot prepare is logged there, and its parts
        meet the fault themselves."""
        with self._lock:
            if self.alive:
                try:
                    self._requests.send_bytes(pickle.dumps((PREPARED, tuple(roots), timeout_s)))
                except OSError:  # the helper is exiting: its reader marks it dead, and the next part starts another
                    pass

    def wait_prepared(self, timeout_s: float) -> bool:
        """Whether the helper has answered a `prepare` within `timeout_s`."""
        return self._prepared.wait(timeout_s)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the helper has started (imported what it fetches with) within `timeout_s`."""
        return self._ready.wait(timeout_s)

    def _read(self) -> None:
        replies = Connection(self._replies_read, writable=False)
        while True:
            try:
                part_id, digest, error = pickle.loads(replies.recv_bytes())
            except (EOFError, OSError):
                break
            if part_id in (READY, PREPARED):
                (self._ready if part_id == READY else self._prepared).set()
                continue
            with self._lock:
                future = self._pending.pop(part_id, None)
            if future is not None:
                future.set_result(digest) if error is None else future.set_exception(error)
        replies.close()
        code = self._process.wait()
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        if pending:
            log.error("the adapter download process exited (code %s) with %d parts in flight", code, len(pending))
        for future in pending.values():
            future.set_exception(AdapterStoreUnavailable(f"the adapter download process exited (code {code})"))


_helpers: dict[int, PartProcess] = {}
_helpers_lock = threading.Lock()


def helper() -> PartProcess:
    """This process's helper for the current environment, started (again, if it died) on first use."""
    key = hash(frozenset(os.environ.items()))
    with _helpers_lock:
        found = _helpers.get(key)
        if found is None or not found.alive:
            found = _helpers[key] = PartProcess()
        return found
