"""Remote adapters' bytes: read through the node's disk cache, and fetched into it ahead of their requests.

The registry validates a remote adapter from its config and safetensors header alone; its weights come here
when a load first reads them (`read`) or when a hint or a queued request asks for them early (`fetch_ahead`).
A copy in the cache is keyed by URI and version, so an object changed in its store since registration is
fetched again and validated against the registration before anything reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from app.adapters.format import CONFIG_NAME
from app.adapters.node_cache import CacheKey, NodeCache
from app.adapters.part_digests import PartDigests
from app.adapters.remote import ObjectChanged, RemoteStore
from app.adapters.safetensors_file import WEIGHTS_NAME
from app.adapters.spec import AdapterSpec, RemoteFiles, StoredAdapter, read_adapter
from app.errors import AdapterInvalid, AdapterLoadFailed
from prefetch.threads import one_cpu_thread

log = logging.getLogger(__name__)
FAILED_FETCH_PAUSE_S = 5.0  # after a failed fetch, how long fetches ahead leave that adapter to its reads

# (adapter_id, folder, weights file, config file) -> the spec of a local copy, fully checked
ValidateFiles = Callable[[str, Path, Path, Path], AdapterSpec]


class RemoteFetcher:
    """Reads remote adapters through `cache` (None: the ingress's validator, which never reads weights) and
    fetches them ahead, each fetch on a thread of its own: up to `workers` at once for requests still in the
    router, and every one for requests already at the replica. Thread-safe: loads read on worker threads, the
    engine thread asks `is_cached` and calls `fetch_ahead` at every step."""

    def __init__(self, store: RemoteStore, cache: NodeCache | None, workers: int, validate_files: ValidateFiles):
        self.store, self.cache, self._validate_files = store, cache, validate_files
        self.workers = workers
        self._lock = threading.Lock()
        self._fetching: set[CacheKey] = set()  # fetches under way
        self._failed_at: dict[CacheKey, float] = {}  # fetches that failed -> when (time.monotonic())
        self._on_node: set[CacheKey] = set()  # copies this replica has seen on the node (see _held)
        # (URI, registered version) -> a newer version of its files, fetched and validated since
        self._newer: dict[tuple[str, str], RemoteFiles] = {}
        self._ahead = {"fetched_ahead": 0, "fetched_ahead_bytes": 0, "fetched_ahead_used": 0,
                       "fetched_ahead_used_bytes": 0}
        self._unused_ahead: dict[CacheKey, int] = {}  # fetched ahead, not read since: key -> bytes
        self._closed = False

    def read(self, spec: AdapterSpec, check_finite: bool = False) -> StoredAdapter:
        """The adapter's file from the node cache, fetched first where the node does not hold it. A request
        waits for this read, so its download (or the fetch ahead already under way for it) takes the store's
        connections ahead of other fetches ahead. A copy that passed the cache's check yet fails to load holds
        the store's bytes: it is dropped, so that the next read downloads it again."""
        uri = str(spec.path)
        with self.store.parts.waited_for(uri):
            with self._fetched(spec) as (local, fresh):
                key = self._cache_key(spec)
                with self._lock:
                    if (nbytes := self._unused_ahead.pop(key, None)) is not None:
                        self._ahead["fetched_ahead_used"] += 1
                        self._ahead["fetched_ahead_used_bytes"] += nbytes
                try:
                    return read_adapter(local, check_finite, fix=_store_fix(uri, fresh))
                except AdapterLoadFailed as e:
                    unusable = e
            self.cache.discard(key)  # once out of the block, which held it against eviction
            with self._lock:
                self._on_node.discard(key)
            raise unusable

    def fetch_ahead(self, specs: Sequence[AdapterSpec], urgent: Collection[str] = ()) -> int:
        """Start fetching `specs` (remote ones, nearest need first) into the node cache, only while those named so
        far fit in half the cache: a fetch for a request far back must not evict an adapter that a nearer one
        needs. `urgent`: the adapter ids of requests already at this replica, which wait for their adapters:
        their fetches always start, and their ranges go first, as a read's do (a fetch under way already of such
        an adapter has its ranges go first from then on). The others start while fewer than `workers` fetches
        run; the engine calls this at every step, so the rest start, nearest first, as fetches end. Returns how
        many fetches started. Never blocks and never raises: a failed fetch is logged, and the request that
        needs the adapter meets the fault when its own read repeats it."""
        if self.cache is None:
            return 0
        self.store.parts.set_queued({str(spec.path) for spec in specs if spec.adapter_id in urgent})
        room, started = self.cache.budget_bytes // 2, 0
        for spec in specs:
            room -= spec.nbytes
            if room < 0:
                break
            key, is_urgent = self._cache_key(spec), spec.adapter_id in urgent
            with self._lock:
                if (self._closed or key in self._fetching or self._held(key) or self._failed_lately(key)
                        or (not is_urgent and len(self._fetching) >= self.workers)):
                    continue
                self._fetching.add(key)
            threading.Thread(target=self._fetch_one, args=(spec, key, is_urgent), name="adapter-fetch",
                             daemon=True).start()
            started += 1
        return started

    def is_fetching(self, spec: AdapterSpec) -> bool:
        """Whether a fetch of the adapter (ahead, or for a request here) is under way."""
        key = self._cache_key(spec)
        with self._lock:
            return key in self._fetching

    def is_cached(self, spec: AdapterSpec) -> bool:
        """Whether the node holds the adapter's files."""
        return self.cache is not None and self._held(self._cache_key(spec))

    def snapshot(self) -> dict:
        """The node cache's counters and this replica's fetches ahead: started, and used by a read since."""
        with self._lock:
            ahead, running = dict(self._ahead), len(self._fetching)
        return {**self.cache.snapshot(), **ahead, "fetches_running": running}

    def shutdown(self) -> None:
        """No fetch starts from now on; those under way end as the store's pool cancels their parts."""
        with self._lock:
            self._closed = True

    def _fetch_one(self, spec: AdapterSpec, key: CacheKey, is_urgent: bool) -> None:
        one_cpu_thread()  # the download's finiteness check runs torch ops beside the engine (prefetch/threads.py)

        def downloaded(nbytes: int) -> None:  # before the entry is visible: no read can come first
            with self._lock:
                self._ahead["fetched_ahead"] += 1
                self._ahead["fetched_ahead_bytes"] += nbytes
                self._unused_ahead[key] = nbytes

        try:
            with self._fetched(spec, downloaded):
                pass
        except Exception as e:  # noqa: BLE001 - logged here; the request's own read raises it to its client
            log.warning("fetching adapter %r %s failed: %s", spec.adapter_id,
                        "for a request queued here" if is_urgent else "ahead", e)
            with self._lock:
                self._failed_at[key] = time.monotonic()
        finally:
            with self._lock:
                self._fetching.discard(key)

    def _failed_lately(self, key: CacheKey) -> bool:
        """Whether a fetch of `key` failed less than FAILED_FETCH_PAUSE_S ago: no fetch ahead asks the store for it
        again meanwhile, so the load of a request that wants it reads through and meets the fault itself."""
        failed_at = self._failed_at.get(key)
        if failed_at is None:
            return False
        if time.monotonic() - failed_at < FAILED_FETCH_PAUSE_S:
            return True
        del self._failed_at[key]
        return False

    def _held(self, key: CacheKey) -> bool:
        """Whether the node holds `key`'s copy: known here once this replica has used or fetched it (no file-system
        call on the engine thread, which asks for every demanded adapter at every step), else asked of the cache.
        A copy another replica evicted since is found missing by the read, which fetches it again."""
        if key in self._on_node:
            return True
        if self.cache.contains(key):
            self._on_node.add(key)
            return True
        return False

    def _cache_key(self, spec: AdapterSpec) -> CacheKey:
        """The key of the version this node serves: the registered one, or a newer one validated since."""
        with self._lock:
            files = self._newer.get((str(spec.path), spec.remote.version), spec.remote)
        return CacheKey(str(spec.path), files.version)

    @contextmanager
    def _fetched(self, spec: AdapterSpec, downloaded: Callable[[int], None] | None = None
                 ) -> Iterator[tuple[AdapterSpec, bool]]:
        """The spec of the adapter's copy in the node cache, held there for the block, and whether this call
        downloaded it. A miss downloads the version last known, asking the store nothing first: the bytes are
        checked against that version, and if they are another's, the store is asked for the object's current
        version, whose bytes are fetched and validated against the registration before anything reads them.
        `downloaded(nbytes)` is called when this call is the one that downloads it, before the copy becomes
        visible."""
        if self.cache is None:
            raise AdapterLoadFailed(f"adapter '{spec.adapter_id}': remote adapters need a node cache "
                                    "(adapter_cache_dir)")
        with self._lock:
            files = self._newer.get((str(spec.path), spec.remote.version), spec.remote)
        with ExitStack() as held:
            try:
                folder, fresh = held.enter_context(self._entry(spec, files, downloaded))
            except ObjectChanged as e:
                asked = {e.current.uri: e.current} if e.current is not None else {}  # the check's answer, reused
                known, files = files, RemoteFiles(*(asked.get(f.uri) or self.store.stat(f.uri)
                                                    for f in (files.config, files.weights)))
                if files.version == known.version:
                    raise
                log.info("adapter %r changed in its store since registration; validating the new version",
                         spec.adapter_id)
                folder, fresh = held.enter_context(self._entry(spec, files, downloaded))
            yield replace(spec, path=folder, weights_file=folder / WEIGHTS_NAME, nbytes=files.weights.size,
                          remote=None), fresh

    @contextmanager
    def _entry(self, spec: AdapterSpec, files: RemoteFiles, downloaded: Callable[[int], None] | None
               ) -> Iterator[tuple[Path, bool]]:
        """The folder of `files`' copy in the node cache, downloaded there on a miss (or where the copy there
        fails its check), held for the block; and whether this call downloaded it."""
        changed = files.version != spec.remote.version
        nbytes = files.config.size + files.weights.size
        uri = str(spec.path)
        fresh = False

        def fill(folder: Path) -> dict[str, PartDigests]:
            nonlocal fresh
            digests = self.store.download_all(
                [(files.config, folder / CONFIG_NAME), (files.weights, folder / WEIGHTS_NAME)], key=uri)
            if changed:  # before the rename makes it visible to anyone
                try:
                    now = self._validate_files(spec.adapter_id, folder, folder / WEIGHTS_NAME, folder / CONFIG_NAME)
                except AdapterInvalid as e:  # a read fails as `read_adapter` fails: AdapterLoadFailed
                    raise AdapterLoadFailed(f"{e.message} (its new version in the store: replace it there)") from e
                _check_same(spec, now)
            if downloaded is not None:
                downloaded(nbytes)
            fresh = True
            return {path.name: part_digests for path, part_digests in digests.items()}

        key = CacheKey(str(spec.path), files.version)
        with self.cache.entry(key, nbytes, fill) as folder:
            with self._lock:
                self._on_node.add(key)
                if changed:  # validated: later reads go to this version's copy without asking the store again
                    self._newer[(str(spec.path), spec.remote.version)] = files
            yield folder, fresh


def _store_fix(uri: str, fresh: bool) -> str:
    """What recovers an adapter whose copy on the node passed the cache's check, so holds its store's bytes, yet
    fails to load (the copy is dropped)."""
    if fresh:
        return f"downloaded from {uri} just now: its store holds these bytes, so replace them there"
    return f"as downloaded from {uri} before: the node's copy is dropped, and the next read downloads it again"


def _check_same(registered: AdapterSpec, now: AdapterSpec) -> None:
    for field in ("module_ranks", "module_scales", "module_shapes"):
        if dict(getattr(registered, field)) != dict(getattr(now, field)):
            raise AdapterLoadFailed(
                f"adapter '{registered.adapter_id}': {registered.path} changed in its store since registration, "
                f"and its {field.removeprefix('module_')} no longer match; re-register it")
