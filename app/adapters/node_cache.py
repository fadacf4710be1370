"""The node's disk cache of remote adapters: the tier between a remote store and a replica's pinned host arena.

One folder per (URI, version), holding the adapter's two files. Every replica of a node shares it, and it
outlives them. Written by hand because fsspec's caching filesystems (filecache, simplecache) keep no byte budget
across processes, do not lock entries that are being read against eviction, and key by path, not by version.

- A download goes to a temporary folder, is checked (sizes; checksums where the store gives them) and renamed
  into place, so an interrupted download never leaves a partial adapter behind. Its key and its files' digests,
  hashed as the parts arrived, go into the folder's record (MANIFEST) before the rename.
- An entry is checked before a process first uses it, and again if a file of it changed since: its files must be
  those of its record, in size and digest. One that fails (damaged on disk, or put there by anything but this
  cache) is replaced by a fresh download.
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
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.adapters.part_digests import PartDigests, file_digests
from app.errors import AdapterCacheFull

log = logging.getLogger(__name__)
MANIFEST = ".manifest.json"  # an entry's record: its key and its files' digests, written with it
_PART_BYTES = 16 * 1024 * 1024  # the parts of a file hashed here, where its fill did not hash them
# Writes an entry's files into an empty folder; returns the digests of those it hashed as they arrived.
Fill = Callable[[Path], Mapping[str, PartDigests] | None]


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
    failed_checks: int = 0  # entries that failed their check before this process used them: downloaded again
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
        # entry folder -> (its files' identity when this process checked it, why it failed or None)
        self._checked: dict[Path, tuple[tuple, str | None]] = {}
        self._checked_lock = threading.Lock()
        self._sweep_abandoned()
        self._counted_bytes = self.used_bytes()  # under _stats_lock: as of this process's last count

    def path(self, key: CacheKey) -> Path:
        return self.objects / key.digest

    def contains(self, key: CacheKey) -> bool:
        """Whether the node holds an entry for `key` (not read: its first use here checks it)."""
        return self.path(key).is_dir()

    @contextmanager
    def entry(self, key: CacheKey, nbytes: int, fill: Fill) -> Iterator[Path]:
        """The entry's folder, checked and held against eviction for the `with` block. On a miss, or where the
        entry fails its check, `fill(folder)` writes the files into an empty temporary folder (raising on any
        fault); it runs once per node however many replicas ask at once."""
        if nbytes > self.budget_bytes:
            raise AdapterCacheFull(f"{key.uri} is {nbytes} bytes, more than adapter_cache_bytes "
                                   f"({self.budget_bytes}); raise it", retry_after_s=None)
        with open(self.locks / f"{key.digest}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if not self._is_sound(key):  # missing or bad: take the lock exclusively to fill it (or wait for whoever is)
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self._is_sound(key):
                    self._count(waited_for_other=1)
                else:
                    self._fill(key, nbytes, fill)
                fcntl.flock(lock, fcntl.LOCK_SH)  # eviction could slip in between: checked below
                if not self._is_sound(key):
                    raise AdapterCacheFull(f"{key.uri}: evicted from the node cache as it arrived; the cache "
                                           "is too small for the adapters in use", retry_after_s=1)
            else:
                self._count(hits=1)
            target = self.path(key)
            now = time.time()
            os.utime(target, (now, now))
            yield target

    def discard(self, key: CacheKey) -> bool:
        """Evict `key`'s entry now, unless it is being read or filled: its files passed their check, so they are
        the store's bytes, yet proved unusable; the next use downloads them again."""
        folder = self.path(key)
        try:
            size = _size(folder)
        except FileNotFoundError:
            return False
        if not self._evict(folder):
            return False
        self._count(evictions=1, evicted_bytes=size)
        with self._stats_lock:
            self._counted_bytes -= size
        return True

    def _is_sound(self, key: CacheKey) -> bool:
        """Whether `key`'s entry exists and passes its check: its files are read and compared with its record the
        first time this process uses it, and again whenever one of them changed (inode, size or mtime) since."""
        folder = self.path(key)
        identity = _identity(folder)
        if identity is None:
            return False
        with self._checked_lock:
            checked = self._checked.get(folder)
        if checked is not None and checked[0] == identity:
            return checked[1] is None
        problem = _problem(key, folder)
        with self._checked_lock:
            self._checked[folder] = (identity, problem)
        if problem is not None:
            log.warning("%s: its copy in the node cache (%s) fails its check: %s; downloading it again", key.uri,
                        folder, problem)
            self._count(failed_checks=1)
        return problem is None

    def _fill(self, key: CacheKey, nbytes: int, fill: Fill) -> None:
        started = time.perf_counter()
        target = self.path(key)
        if target.exists():  # it failed its check; this process holds its lock exclusively, so no one reads it
            shutil.rmtree(self._set_aside(target), ignore_errors=True)
        for attempt in (0, 1):
            self._make_room(nbytes)
            staging = Path(tempfile.mkdtemp(prefix=f"{key.digest}.", dir=self.tmp))
            try:
                _write_manifest(key, staging, fill(staging) or {})
                os.rename(staging, target)
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
        with self._checked_lock:  # hashed as it arrived: this process need not read it again
            self._checked[target] = (_identity(target), None)

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
            try:
                doomed = self._set_aside(folder)
            except FileNotFoundError:
                return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def _set_aside(self, folder: Path) -> Path:
        """Move an entry out of objects/, so it is gone at once for everyone, to be deleted at leisure."""
        doomed = self.tmp / f"evicted.{folder.name}.{os.getpid()}.{threading.get_ident()}"
        os.rename(folder, doomed)
        return doomed

    def _entries(self) -> list[tuple[Path, float, int]]:
        """(folder, last use, bytes) of every complete entry."""
        out = []
        for folder in self.objects.iterdir():
            try:
                out.append((folder, folder.stat().st_mtime, _size(folder)))
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


def _size(folder: Path) -> int:
    """The bytes of an entry's files (its record, a few hundred bytes, is not counted against the budget)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.name != MANIFEST)


def _identity(folder: Path) -> tuple | None:
    """(name, inode, size, mtime) of each file of an entry, which changes when any of them is written or replaced;
    None where there is no such entry."""
    try:
        stats = [(f.name, f.stat()) for f in folder.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return None
    return tuple(sorted((name, stat.st_ino, stat.st_size, stat.st_mtime_ns) for name, stat in stats))


def _write_manifest(key: CacheKey, folder: Path, reported: Mapping[str, PartDigests]) -> None:
    """Record `key` and the digests of every file in a new entry's folder, before its rename makes it visible: as
    its fill reported them, else hashed here."""
    files = {f.name: reported.get(f.name) or file_digests(f, _PART_BYTES) for f in sorted(folder.iterdir())}
    record = {"uri": key.uri, "version": key.version, "files": {name: d.to_json() for name, d in files.items()}}
    (folder / MANIFEST).write_text(json.dumps(record))


def _problem(key: CacheKey, folder: Path) -> str | None:
    """Why the entry in `folder` is not what this cache downloaded for `key`; None where it is (reads its files)."""
    if not (folder / MANIFEST).exists():
        return "it has no record of its digests (this cache did not write it)"
    try:
        record = json.loads((folder / MANIFEST).read_bytes())
        files = {name: PartDigests.from_json(d) for name, d in record["files"].items()}
        if (record["uri"], record["version"]) != (key.uri, key.version):
            return f"its record is of {record['uri']} version {record['version']}"
        present = sorted(f.name for f in folder.iterdir() if f.name != MANIFEST)
        if present != sorted(files):
            return f"it holds {present}, its record lists {sorted(files)}"
        for name, digests in files.items():
            if (problem := digests.mismatch(folder / name)) is not None:
                return problem
        return None
    except OSError as e:
        return f"it cannot be read ({e})"
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not the record's shape
        return f"its record is unreadable ({type(e).__name__}: {e})"
