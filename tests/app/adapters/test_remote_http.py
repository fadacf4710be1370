"""Adapters under an http(s):// root, against real servers (http.server, and a foreign one to redirect to): they
register, are discovered and read like local ones; a forbidden file is denied; redirects are followed only under
the roots, for stats and for downloads; a server that ignores Range costs the reader no more than the range; an
object changed between reads, or a body cut short, is a 503 that says so.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from adapter_helpers import make_adapter
from app.adapters import remote
from app.adapters.node_cache import NodeCache
from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME
from app.errors import (
    AdapterFormatError,
    AdapterPathOutsideRoots,
    AdapterSourceDenied,
    AdapterSourceMissing,
    AdapterStoreUnavailable,
)
from deploy.args import AppArgs
import store_helpers
from store_helpers import assert_same_bytes

file_server, foreign_server, registries = (  # the fixtures, under their names
    store_helpers.file_server, store_helpers.foreign_server, store_helpers.registries)


def test_http_root_registers_discovers_and_reads_like_local(file_server, registries, tmp_path):
    www = tmp_path / "www" / "adapters"
    make_adapter(www / "a", r=4)
    make_adapter(www / "b", r=2, lora_alpha=4, target_modules=["o_proj"])
    (www / "notes").mkdir()
    root = f"{file_server.url}/adapters"
    registry = registries([root], cache=NodeCache(tmp_path / "cache", 1 << 20))
    local = registries([www])
    assert registry.store.discover(registry.store.roots[0], CONFIG_NAME) == {"a": f"{root}/a", "b": f"{root}/b"}
    assert AppArgs(adapter_roots=[root]).initial_adapters() == {"a": f"{root}/a", "b": f"{root}/b"}
    for name in "ab":
        spec = registry.register(name, f"{root}/{name}")
        assert spec.remote.weights.checksum is None and spec.remote.weights.version.startswith("modified:")
        assert_same_bytes(registry.read(spec, check_finite=True), local.read(local.register(name, name)))
    gets = sum(file_server.gets.values())
    registry.read(registry.get("a"))
    assert sum(file_server.gets.values()) == gets  # a cache hit asks the server nothing
    with pytest.raises(AdapterSourceMissing) as error:
        registry.register("c", f"{root}/c")
    assert error.value.status_code == 404


def test_http_forbidden_is_denied(file_server, registries, tmp_path):
    make_adapter(tmp_path / "www" / "private" / "a", r=4)
    file_server.forbidden = ("/private/",)
    root = f"{file_server.url}/private"
    with pytest.raises(AdapterSourceDenied, match="Forbidden") as error:
        registries([root]).register("a", f"{root}/a")
    assert error.value.status_code == 400


def test_http_redirects_are_followed_only_under_the_roots(file_server, foreign_server, registries, tmp_path):
    make_adapter(tmp_path / "www" / "adapters" / "a", r=4)
    (tmp_path / "foreign" / "secret").mkdir()
    (tmp_path / "foreign" / "secret" / WEIGHTS_NAME).write_bytes(b"top secret data")
    root, foreign = f"{file_server.url}/adapters", f"{foreign_server.url}/secret/{WEIGHTS_NAME}"
    file_server.redirects = {
        f"/adapters/b/{name}": f"/adapters/a/{name}" for name in (CONFIG_NAME, WEIGHTS_NAME)}  # inside: followed
    file_server.redirects[f"/adapters/out/{CONFIG_NAME}"] = f"/adapters/a/{CONFIG_NAME}"
    file_server.redirects[f"/adapters/out/{WEIGHTS_NAME}"] = foreign
    file_server.redirects[f"/adapters/loop/{WEIGHTS_NAME}"] = f"/adapters/loop/{WEIGHTS_NAME}"
    registry = registries([root])
    assert registry.register("b", f"{root}/b").rank == 4
    with pytest.raises(AdapterPathOutsideRoots) as error:
        registry.register("out", f"{root}/out")
    assert error.value.status_code == 400
    assert f"redirect to {foreign} leaves the adapter roots ['{root}']" in error.value.message
    assert not foreign_server.gets and not foreign_server.heads  # refused before it was followed
    with pytest.raises(AdapterPathOutsideRoots, match="more than 5 redirects"):
        registry.register("loop", f"{root}/loop")


def test_http_download_redirected_out_of_the_roots_is_refused(file_server, foreign_server, registries, tmp_path):
    # The download's parts go through the same redirect guard as the registration's reads.
    make_adapter(tmp_path / "www" / "adapters" / "a", r=4)
    (tmp_path / "foreign" / "a").mkdir()
    weights = (tmp_path / "www" / "adapters" / "a" / WEIGHTS_NAME).read_bytes()
    (tmp_path / "foreign" / "a" / WEIGHTS_NAME).write_bytes(weights)  # the same bytes, elsewhere: still refused
    root = f"{file_server.url}/adapters"
    registry = registries([root], cache=NodeCache(tmp_path / "cache", 1 << 20))
    spec = registry.register("a", f"{root}/a")
    file_server.redirects = {f"/adapters/a/{WEIGHTS_NAME}": f"{foreign_server.url}/a/{WEIGHTS_NAME}"}
    with pytest.raises(AdapterPathOutsideRoots, match="leaves the adapter roots"):
        registry.read(spec)
    assert not foreign_server.gets and not foreign_server.heads and not registry.is_cached(spec)


def test_http_store_that_ignores_range_holds_only_the_range(file_server, registries, tmp_path):
    # http.server answers every ranged GET with the whole file: a 1 GiB sparse one here.
    folder = tmp_path / "www" / "adapters" / "padded"
    make_adapter(folder, r=4)
    with open(folder / WEIGHTS_NAME, "r+b") as f:
        f.truncate(1 << 30)
    root = f"{file_server.url}/adapters"
    registry = registries([root])
    tracemalloc.start()
    try:
        with pytest.raises(AdapterFormatError, match="truncated or padded"):
            registry.register("padded", f"{root}/padded")
        after_failure, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        middle = registry.store.read(f"{root}/padded/{WEIGHTS_NAME}", 256 << 20, (256 << 20) + 4096)
        _, middle_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20 and after_failure < 8 << 20, (peak, after_failure)
    assert bytes(middle) == bytes(4096) and middle_peak < 32 << 20, middle_peak


def test_http_object_changed_between_reads_is_reported_as_changed(file_server, registries, tmp_path):
    folder = tmp_path / "www" / "adapters" / "a"
    make_adapter(folder, r=4)
    root = f"{file_server.url}/adapters"
    registry = registries([root])
    file_server.hold = threading.Event()  # the stat answers first, then the object changes, then the reads go
    with ThreadPoolExecutor(1) as pool:
        registering = pool.submit(registry.register, "a", f"{root}/a")
        deadline = time.monotonic() + 30
        while not file_server.heads[f"/adapters/a/{WEIGHTS_NAME}"]:
            assert time.monotonic() < deadline and not registering.done()
            time.sleep(0.01)
        make_adapter(folder, r=8)  # another size
        file_server.hold.set()
        with pytest.raises(remote.ObjectChanged) as error:
            registering.result(timeout=30)
    assert error.value.status_code == 503 and error.value.retry_after_s > 0
    assert f"{root}/a/{WEIGHTS_NAME} changed between reads: its size went from" in error.value.message
    assert "truncated or padded" not in error.value.message
    assert registry.register("a", f"{root}/a").rank == 8  # the retry that Retry-After asks for


def test_http_short_body_is_reported_when_the_connection_ends(file_server, registries, tmp_path):
    make_adapter(tmp_path / "www" / "adapters" / "a", r=4)
    root = f"{file_server.url}/adapters"
    registry = registries([root], cache=NodeCache(tmp_path / "cache", 1 << 20), fetch_timeout_s=30)
    spec = registry.register("a", f"{root}/a")
    file_server.short_by = 100  # each body ends 100 bytes short of its Content-Length, and the connection closes
    for attempt in (lambda: registry.register("again", f"{root}/a"), lambda: registry.read(spec)):
        started = time.monotonic()
        with pytest.raises(AdapterStoreUnavailable, match="sent fewer bytes than it announced") as error:
            attempt()
        assert time.monotonic() - started < 10 and error.value.retry_after_s > 0
        assert "closed the connection" in error.value.message
