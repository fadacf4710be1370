"""The node's disk cache of remote adapters: the tier between a remote store and a replica's pinned host arena.

One folder per (URI, version), holding the adapter's two files. Every replica of a node shares it, and it
outlives them. Written by hand because fsspec's caching filesystems (filecache, simplecache) keep no byte budget
across processes, do not lock entries that are being read against eviction, and key by path, not by version.

- A download goes to a temporary folder, is checked (sizes; checksums where the store gives them) and renamed
  into place, so an interrupted download never leaves a partial adapter behind.
- Each entry has a lock file. The downloader holds it exclusively, so two replicas never fetch the same
  adapter twice; a reader holds it shared while it reads; eviction takes it exclusively without waiting, so an
  entry being read or written is never evicted.
- Least recently used first (an entry's mtime is touched on every use), within `budget_bytes`. A full disk
  (ENOSPC) evicts as much as it can and retries once, then fails that download with AdapterCacheFull.
- `snapshot()` touches no file: the engine thread reports it several times a second, and a scan of the folder
  there makes a stat call per file, each one letting go of the GIL and waiting to take it back from the
  download threads. Its `used_bytes` is as this process last counted it, at its start and at each of its own
  downloads; `used_bytes()` counts anew.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.errors import AdapterCacheFull

log = logging.getLogger(__name__)


def default_directory() -> Path:
    """$XDG_CACHE_HOME/lora-serve/adapters, else ~/.cache/lora-serve/adapters."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lora-serve" / "adapters"


@dataclass(frozen=True)
class CacheKey:
    uri: str
    version: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.uri}\0{self.version}".encode()).hexdigest()[:32]


@dataclass
class CacheStats:
    hits: int = 0
    downloads: int = 0
    downloaded_bytes: int = 0
    download_seconds: float = 0.0
    waited_for_other: int = 0  # another replica of the node was downloading it: read after it finished
    evictions: int = 0
    evicted_bytes: int = 0


class NodeCache:
    """Remote adapters on this node's disk, shared by its replicas through the file system and its locks."""

    def __init__(self, directory: str | Path, budget_bytes: int):
        if budget_bytes < 1:
            raise ValueError(f"adapter_cache_bytes ({budget_bytes}) must be >= 1")
        self.directory = Path(directory).expanduser().resolve()
        self.budget_bytes = budget_bytes
        self.objects, self.tmp, self.locks = (self.directory / name for name in ("objects", "tmp", "locks"))
        for folder in (self.objects, self.tmp, self.locks):
            folder.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._sweep_abandoned()
        self._counted_bytes = self.used_bytes()  # under _stats_lock: as of this process's last count

    def path(self, key: CacheKey) -> Path:
        return self.objects / key.digest

    def contains(self, key: CacheKey) -> bool:
        return self.path(key).is_dir()

    @contextmanager
    def entry(self, key: CacheKey, nbytes: int, fill: Callable[[Path], None]) -> Iterator[Path]:
        """The entry's folder, held against eviction for the `with` block. On a miss, `fill(folder)` writes the
        files into an empty temporary folder (raising on any fault); it runs once per node however many
        replicas ask at once."""
        if nbytes > self.budget_bytes:
            raise AdapterCacheFull(f"{key.uri} is {nbytes} bytes, more than adapter_cache_bytes "
                                   f"({self.budget_bytes}); raise it", retry_after_s=None)
        with open(self.locks / f"{key.digest}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            target = self.path(key)
            if not target.is_dir():  # a miss: take the lock exclusively to fill it (or wait for whoever is)
                fcntl.flock(lock, fcntl.LOCK_EX)
                if target.is_dir():
                    self._count(waited_for_other=1)
                else:
                    self._fill(key, nbytes, fill)
                fcntl.flock(lock, fcntl.LOCK_SH)  # eviction could slip in between: checked below
                if not target.is_dir():
                    raise AdapterCacheFull(f"{key.uri}: evicted from the node cache as it arrived; the cache "
                                           "is too small for the adapters in use", retry_after_s=1)
            else:
                self._count(hits=1)
            now = time.time()
            os.utime(target, (now, now))
            yield target

    def _fill(self, key: CacheKey, nbytes: int, fill: Callable[[Path], None]) -> None:
        started = time.perf_counter()
        for attempt in (0, 1):
            self._make_room(nbytes)
            staging = Path(tempfile.mkdtemp(prefix=f"{key.digest}.", dir=self.tmp))
            try:
                fill(staging)
                os.rename(staging, self.path(key))
                break
            except OSError as e:
                shutil.rmtree(staging, ignore_errors=True)
                if e.errno != errno.ENOSPC:
                    raise
                if attempt == 1:
                    raise AdapterCacheFull(f"{key.uri}: the disk under {self.directory} is full, and no cached "
                                           "adapter could be evicted to make room", retry_after_s=5) from e
                log.warning("adapter cache disk full while fetching %s; evicting and retrying", key.uri)
                self._make_room(nbytes, free_disk=True)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        self._count(downloads=1, downloaded_bytes=nbytes, download_seconds=time.perf_counter() - started)
        with self._stats_lock:
            self._counted_bytes += nbytes

    def _make_room(self, nbytes: int, free_disk: bool = False) -> None:
        """Evict least recently used entries, none in use, until `nbytes` more fit the budget (and, with
        free_disk, until the disk has that much free)."""
        with open(self.directory / "evict.lock", "a+b") as evict_lock:
            fcntl.flock(evict_lock, fcntl.LOCK_EX)
            entries = sorted(self._entries(), key=lambda e: e[1])
            used = sum(size for _, _, size in entries)
            for folder, _, size in entries:
                disk_short = free_disk and shutil.disk_usage(self.directory).free < nbytes
                if used + nbytes <= self.budget_bytes and not disk_short:
                    break
                if self._evict(folder):
                    used -= size
                    self._count(evictions=1, evicted_bytes=size)
            with self._stats_lock:
                self._counted_bytes = used

    def _evict(self, folder: Path) -> bool:
        with open(self.locks / f"{folder.name}.lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # being read, or filled
            doomed = self.tmp / f"evicted.{folder.name}.{os.getpid()}.{threading.get_ident()}"
            try:
                os.rename(folder, doomed)  # gone from objects/ at once, deleted at leisure
            except FileNotFoundError:
                return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _entries(self) -> list[tuple[Path, float, int]]:
        """(folder, last use, bytes) of every complete entry."""
        out = []
        for folder in self.objects.iterdir():
            try:
                size = sum(f.stat().st_size for f in folder.iterdir())
                out.append((folder, folder.stat().st_mtime, size))
            except FileNotFoundError:  # evicted meanwhile
                continue
        return out

    def used_bytes(self) -> int:
        return sum(size for _, _, size in self._entries())

    def _sweep_abandoned(self) -> None:
        """Remove temporary folders that no live download owns (a replica killed mid-download)."""
        for staging in self.tmp.iterdir():
            digest = staging.name.split(".", 1)[0]
            if staging.name.startswith("evicted."):
                shutil.rmtree(staging, ignore_errors=True)
                continue
            with open(self.locks / f"{digest}.lock", "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its download is still running
                shutil.rmtree(staging, ignore_errors=True)

    def _count(self, **deltas) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    def snapshot(self) -> dict:
        """The counters, and the bytes in the cache as this process last counted them (no file-system call)."""
        with self._stats_lock:
            stats, used = dict(vars(self.stats)), self._counted_bytes
        return {"directory": str(self.directory), "budget_bytes": self.budget_bytes, "used_bytes": used, **stats}
