"""The helper process of `part_process.py`: reads (part id, object, file, start, end, roots, timeout) requests from
one pipe, fetches each range on a thread of its own and writes it into the file, and answers (part id, the part's
digest, None) or (part id, None, error) on the other pipe; a (PREPARED, roots, timeout) request makes the clients
for those roots, answered (PREPARED, None, None). It exits when the request pipe closes, that is when its parent
goes."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from app.adapters.part_process import PREPARED, READY
from app.adapters.remote import RemoteStore, write_part
from app.errors import AdapterStoreUnavailable, picklable

log = logging.getLogger(__name__)
_THREADS = 64  # parts served at once, over every store of the parent (each store bounds its own)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s adapter-parts %(levelname)s %(message)s")
    requests = Connection(int(sys.argv[1]), writable=False)
    replies = Connection(int(sys.argv[2]), readable=False)
    send_lock, stores_lock = threading.Lock(), threading.Lock()
    # by roots (where redirects may go) and timeout: the filesystems, and their connections, are reused
    stores: dict[tuple[tuple[str, ...], float], RemoteStore] = {}
    pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="adapter-part")
    replies.send_bytes(pickle.dumps((READY, None, None)))

    def store_for(roots: tuple[str, ...], timeout_s: float) -> RemoteStore:
        with stores_lock:
            store = stores.get((roots, timeout_s))
            if store is None:
                store = stores[roots, timeout_s] = RemoteStore(roots, timeout_s, part_process=False)
            return store

    def prepare(_: int, roots: tuple[str, ...], timeout_s: float) -> None:
        store = store_for(roots, timeout_s)
        for root in roots:
            try:
                fs, _ = store.filesystem(root)
                if root.startswith("s3://"):
                    fs.connect()  # the client, and botocore's service model with it; no request to the store
            except Exception as e:  # noqa: BLE001 - a warm-up only: the root's parts meet the fault themselves
                log.warning("preparing the client for %s failed: %s", root, e)
        with send_lock:
            replies.send_bytes(pickle.dumps((PREPARED, None, None)))

    def serve(part_id: int, obj, dest: str, start: int, end: int, roots: tuple[str, ...], timeout_s: float) -> None:
        try:
            digest, error = write_part(store_for(roots, timeout_s), obj, Path(dest), start, end), None
        except BaseException as e:  # noqa: BLE001 - sent to the caller, who raises it
            digest, error = None, picklable(e, AdapterStoreUnavailable)
        data = pickle.dumps((part_id, digest, error))
        with send_lock:
            replies.send_bytes(data)

    while True:
        try:
            message = pickle.loads(requests.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone, or closed its end
        pool.submit(prepare if message[0] == PREPARED else serve, *message)
    pool.shutdown(wait=False, cancel_futures=True)
    os._exit(0)  # parts still running write to files their parent no longer waits for
