"""Downloads' ranged GETs in the helper process: the same bytes and errors as in-process, and a helper that dies
fails only the parts it held, promptly, and is started again for the next."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.adapters import part_process
from app.adapters.node_cache import NodeCache
from app.adapters.registry import AdapterRegistry
from app.adapters.remote import RemoteObject, RemoteStore
from app.errors import AdapterSourceMissing, AdapterStoreUnavailable
from adapter_helpers import BASE
import store_helpers
from store_helpers import silent_server

file_server = store_helpers.file_server


@pytest.fixture
def stores():
    made = []

    def make(root: str, **kwargs) -> RemoteStore:
        made.append(RemoteStore([root], **kwargs))
        return made[-1]

    yield make
    for store in made:
        store.shutdown()


def test_parts_come_from_the_helper_as_from_this_process(file_server, stores, tmp_path, monkeypatch):
    data = os.urandom(300_000)
    (tmp_path / "www" / "weights.bin").write_bytes(data)
    monkeypatch.setattr("app.adapters.remote.PART_BYTES", 65_536)  # five parts, the last one short
    uri = f"{file_server.url}/weights.bin"
    for in_helper in (True, False):
        store = stores(file_server.url, part_process=in_helper)
        dest = tmp_path / f"copy-{in_helper}"
        store.download(store.stat(uri), dest)
        assert dest.read_bytes() == data
    helper = part_process.helper()
    assert helper.alive and helper._process.pid != os.getpid() and helper.wait_ready(0)


def test_a_registry_with_a_node_cache_starts_the_helper_and_its_clients_before_its_first_download(tmp_path,
                                                                                               monkeypatch):
    monkeypatch.setenv("PART_PROCESS_TEST", str(tmp_path))  # an environment of its own: a helper of its own
    environment = hash(frozenset(os.environ.items()))
    assert environment not in part_process._helpers
    registry = AdapterRegistry(["s3://bucket/adapters"], BASE, max_rank=16,
                               cache=NodeCache(tmp_path / "cache", 1 << 20))
    try:
        started = part_process._helpers[environment]
        assert started.wait_ready(30) and part_process.helper() is started
        assert started.wait_prepared(30)  # its S3 client made, with no store to ask: no request goes out for it
    finally:
        registry.shutdown()


def test_the_helpers_errors_keep_their_type_status_and_retry_after(file_server, stores, tmp_path):
    store = stores(file_server.url)
    missing = RemoteObject(f"{file_server.url}/nothing-here.bin", 10, "modified:x/10", None)
    with pytest.raises(AdapterSourceMissing) as error:
        store.download(missing, tmp_path / "missing")
    assert error.value.status_code == 404 and "nothing-here.bin" in error.value.message
    (tmp_path / "www" / "short.bin").write_bytes(b"12345")
    longer = RemoteObject(f"{file_server.url}/short.bin", 9, "modified:x/9", None)
    with pytest.raises(AdapterStoreUnavailable, match="came back as 5 bytes") as error:
        store.download(longer, tmp_path / "short")
    assert error.value.status_code == 503 and error.value.retry_after_s > 0


def test_a_dead_helper_fails_its_parts_at_once_and_the_next_starts_again(stores, tmp_path, file_server):
    with silent_server() as url:
        store = stores(url, timeout_s=60)
        hung = RemoteObject(f"{url}/weights.bin", 100, "modified:x/100", None)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(store.download, hung, tmp_path / "hung")
            helper = part_process.helper()
            deadline = time.monotonic() + 30
            while not helper._pending:  # the part is in the helper, waiting on the silent store
                assert time.monotonic() < deadline and not waiting.done()
                time.sleep(0.01)
            helper._process.kill()
            with pytest.raises(AdapterStoreUnavailable, match="download process exited") as error:
                waiting.result(timeout=10)
    assert error.value.status_code == 503 and error.value.retry_after_s > 0
    (tmp_path / "www" / "w.bin").write_bytes(b"abc" * 1000)
    store = stores(file_server.url)
    store.download(store.stat(f"{file_server.url}/w.bin"), tmp_path / "again")
    assert (tmp_path / "again").read_bytes() == b"abc" * 1000
    assert part_process.helper() is not helper and part_process.helper().alive
