"""The node's disk cache of remote adapters: atomic fills, least recently used eviction within the budget, entries
being read kept, a full disk, restarts, entries checked before use, and two processes on one cache directory (real
processes, real locks)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import store_helpers
from adapter_helpers import make_adapter
from app.adapters import part_digests
from app.adapters.node_cache import CacheKey, NodeCache
from app.adapters.registry import WEIGHTS_NAME
from app.errors import AdapterCacheFull

REPO = Path(__file__).resolve().parents[3]
file_server = store_helpers.file_server  # the fixture, under its name


def key(name: str) -> CacheKey:
    return CacheKey(f"s3://bucket/adapters/{name}", "etag:1/100")


def writes(nbytes: int, fill: bytes = b"w"):
    def fill_folder(folder: Path) -> None:
        (folder / "weights").write_bytes(fill * nbytes)
    return fill_folder


def never(folder: Path) -> None:
    raise AssertionError("a cached entry was fetched again")


def use(cache: NodeCache, name: str, nbytes: int = 100) -> None:
    with cache.entry(key(name), nbytes, writes(nbytes)) as folder:
        assert (folder / "weights").stat().st_size == nbytes


def cached(cache: NodeCache, names) -> list[bool]:
    return [cache.contains(key(name)) for name in names]


def test_a_failed_fill_leaves_nothing_behind(tmp_path):
    cache = NodeCache(tmp_path, 1000)

    def fails_midway(folder: Path) -> None:
        (folder / "weights").write_bytes(b"half an adapter")
        raise ConnectionResetError("the store hung up")

    with pytest.raises(ConnectionResetError):
        with cache.entry(key("a"), 100, fails_midway):
            pass
    assert cached(cache, "a") == [False] and list(cache.tmp.iterdir()) == [] and cache.used_bytes() == 0
    use(cache, "a")
    with cache.entry(key("a"), 100, never) as folder:
        assert (folder / "weights").read_bytes() == b"w" * 100
    assert (cache.stats.downloads, cache.stats.hits) == (1, 1)


def test_least_recently_used_entries_go_first_within_the_budget(tmp_path):
    cache = NodeCache(tmp_path, 300)
    for name in "abc":
        use(cache, name)
    use(cache, "a")  # a hit: now the most recently used
    use(cache, "d")
    assert cached(cache, "abcd") == [True, False, True, True]
    assert cache.used_bytes() == 300
    assert (cache.stats.evictions, cache.stats.evicted_bytes, cache.stats.hits) == (1, 100, 1)
    with pytest.raises(AdapterCacheFull, match="is 301 bytes, more than adapter_cache_bytes"):
        with cache.entry(key("huge"), 301, never):
            pass


def test_an_entry_being_read_is_never_evicted(tmp_path):
    cache = NodeCache(tmp_path, 200)
    with cache.entry(key("a"), 100, writes(100, b"a")) as held:
        use(cache, "b")
        use(cache, "c")  # a is the least recently used, but held: b goes
        assert cached(cache, "abc") == [True, False, True]
        with cache.entry(key("d"), 100, writes(100)):  # c goes
            use(cache, "e")  # a and d held: nothing can go, and the budget yields to the readers
            assert cached(cache, "acde") == [True, False, True, True] and cache.used_bytes() == 300
        assert (held / "weights").read_bytes() == b"a" * 100
    use(cache, "f")
    assert cached(cache, "adef") == [False, False, True, True]


def _disk_freed_by_evictions(cache: NodeCache, per_eviction: int):
    return lambda path: SimpleNamespace(total=10**12, used=10**12, free=per_eviction * cache.stats.evictions)


def test_a_full_disk_evicts_and_retries_once(tmp_path, monkeypatch):
    cache = NodeCache(tmp_path, 1000)
    use(cache, "a")
    use(cache, "b")
    # ENOSPC is simulated: the fill raises it once, and the disk reports as free only what evictions gave back.
    monkeypatch.setattr(shutil, "disk_usage", _disk_freed_by_evictions(cache, 100))
    attempts = []

    def fill(folder: Path) -> None:
        attempts.append(folder)
        if len(attempts) == 1:
            (folder / "weights").write_bytes(b"w" * 50)
            raise OSError(errno.ENOSPC, "No space left on device")
        writes(100)(folder)

    with cache.entry(key("c"), 100, fill) as folder:
        assert (folder / "weights").stat().st_size == 100
    assert len(attempts) == 2 and cached(cache, "abc") == [False, True, True]
    assert (cache.stats.evictions, cache.stats.downloads) == (1, 3) and list(cache.tmp.iterdir()) == []


def test_a_full_disk_with_nothing_to_evict_is_cache_full(tmp_path, monkeypatch):
    cache = NodeCache(tmp_path, 1000)
    use(cache, "a")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12, free=0))

    def no_space(folder: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with cache.entry(key("held"), 100, writes(100)):
        with pytest.raises(AdapterCacheFull, match="disk under .* is full") as error:
            with cache.entry(key("b"), 100, no_space):
                pass
        assert cached(cache, ["a", "held", "b"]) == [False, True, False]  # a evicted for room, held kept
    assert error.value.status_code == 503 and error.value.retry_after_s > 0
    assert list(cache.tmp.iterdir()) == []


def test_entries_are_checked_once_per_process_and_downloaded_again_when_bad(tmp_path, monkeypatch, caplog):
    use(NodeCache(tmp_path, 1000), "a")
    checks = []
    mismatch = part_digests.PartDigests.mismatch
    monkeypatch.setattr(part_digests.PartDigests, "mismatch", lambda self, path: checks.append(path) or
                        mismatch(self, path))
    cache = NodeCache(tmp_path, 1000)  # another process on the node
    for _ in range(3):
        with cache.entry(key("a"), 100, never) as folder:
            assert (folder / "weights").read_bytes() == b"w" * 100
    assert len(checks) == 1 and (cache.stats.hits, cache.stats.failed_checks) == (3, 0)
    shutil.copytree(folder, cache.path(key("b")))  # a sound entry, under another key
    (folder / "new").write_bytes(b"x" * 100)
    (folder / "new").rename(folder / "weights")  # replaced by a file of the right size with other bytes
    cache.path(key("c")).mkdir()
    (cache.path(key("c")) / "weights").write_bytes(b"x" * 100)  # put there by hand: no record of its digests
    with caplog.at_level(logging.WARNING, logger="app.adapters.node_cache"):
        for name in "abc":
            use(cache, name)
            with cache.entry(key(name), 100, never) as folder:
                assert (folder / "weights").read_bytes() == b"w" * 100
    assert (cache.stats.failed_checks, cache.stats.downloads) == (3, 3)
    for reason in ("bytes 0-100 of weights differ from their digest", f"its record is of {key('a').uri}",
                   "it has no record of its digests"):
        assert reason in caplog.text
    assert cache.used_bytes() == 300 and list(cache.tmp.iterdir()) == []


_DIES_MID_DOWNLOAD = """
import sys, time
from pathlib import Path
from app.adapters.node_cache import CacheKey, NodeCache

def fill(folder):
    (folder / "weights").write_bytes(b"part of an adapter")
    print("filling", flush=True)
    time.sleep(120)

with NodeCache(sys.argv[1], 1000).entry(CacheKey("s3://bucket/adapters/b", "etag:1/100"), 100, fill):
    pass
"""


def test_the_cache_outlives_its_processes_and_sweeps_their_abandoned_downloads(tmp_path):
    use(NodeCache(tmp_path, 1000), "a")
    downloader = subprocess.Popen([sys.executable, "-c", _DIES_MID_DOWNLOAD, str(tmp_path)], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True)
    try:
        assert downloader.stdout.readline() == "filling\n"
        NodeCache(tmp_path, 1000)  # a restart beside a live download leaves it alone
        assert [p.name.split(".")[0] for p in (tmp_path / "tmp").iterdir()] == [key("b").digest]
    finally:
        downloader.kill()
        downloader.wait()
    restarted = NodeCache(tmp_path, 1000)
    assert list(restarted.tmp.iterdir()) == [] and cached(restarted, "ab") == [True, False]
    with restarted.entry(key("a"), 100, never) as folder:
        assert (folder / "weights").read_bytes() == b"w" * 100


_FETCH = """
import hashlib, json, sys, time
from pathlib import Path
from app.adapters.node_cache import CacheKey, NodeCache
from app.adapters.remote import RemoteStore

root, uri, directory, ready, go = sys.argv[1:]
store = RemoteStore([root])
obj = store.stat(uri)
cache = NodeCache(directory, 1 << 20)
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.005)
with cache.entry(CacheKey(uri, obj.version), obj.size, lambda folder: store.download(obj, folder / "w")) as folder:
    digest = hashlib.sha256((folder / "w").read_bytes()).hexdigest()
print(json.dumps({"sha256": digest, **vars(cache.stats)}))
"""


def test_two_processes_on_one_cache_download_an_adapter_once(file_server, tmp_path):
    make_adapter(tmp_path / "www" / "adapters" / "a", r=4)
    file_server.delay_s = 0.5  # the first download still runs when the second process asks
    root = f"{file_server.url}/adapters"
    uri = f"{root}/a/{WEIGHTS_NAME}"
    processes = [subprocess.Popen([sys.executable, "-c", _FETCH, root, uri, str(tmp_path / "cache"),
                                   str(tmp_path / f"ready{i}"), str(tmp_path / "go")], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
            [p.stderr.read() for p in processes if p.poll() is not None]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = []
    for process in processes:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    expected = hashlib.sha256((tmp_path / "www" / "adapters" / "a" / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert [result["sha256"] for result in results] == [expected, expected]
    assert sum(result["downloads"] for result in results) == 1
    assert sum(result["waited_for_other"] + result["hits"] for result in results) == 1
    assert file_server.gets[f"/adapters/a/{WEIGHTS_NAME}"] == 1
