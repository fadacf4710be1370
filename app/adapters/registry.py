"""Adapter registry: checks a PEFT LoRA folder against the base model once, then serves its spec by id.

Registration checks the header against the base model first, then streams every value through the NaN/Inf
check in bounded chunks, so a bad adapter is refused before any request uses it and a large file never sits
in memory. `read_adapter` reads the file again at load time, because files may change or vanish after
registration.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import PretrainedConfig

from app.adapters.format import (
    CONFIG_NAME,
    PICKLE_SUFFIXES,
    check_config_matches,
    check_modules,
    read_config,
    read_modules,
    short_name,
)
from app.adapters.node_cache import CacheKey, NodeCache
from app.adapters.remote import RemoteObject, RemoteStore, is_remote
from app.adapters.safetensors_file import WEIGHTS_NAME, AdapterFile, AdapterHeader, check_finite_on_disk, read_header
from app.errors import (
    AdapterAlreadyExists,
    AdapterSourceDenied,
    AdapterSourceMissing,
    AdapterStoreUnavailable,
    AdapterFormatError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterPathOutsideRoots,
    AdapterRankTooHigh,
    AdapterTooLarge,
)
from app.adapters.targets import TARGET_NAMES, target_names, target_shapes

log = logging.getLogger(__name__)
DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3
_MAX_CONFIG_BYTES = 1024 * 1024
_ADAPTER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is a safe name (it ends up in URLs, logs and metrics labels)."""
    if not isinstance(adapter_id, str) or not _ADAPTER_ID_RE.fullmatch(adapter_id) or ".." in adapter_id:
        raise AdapterInvalid(
            f"invalid adapter id {adapter_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'"
        )
    return adapter_id


@dataclass(frozen=True)
class LoRAWeights:
    A: torch.Tensor  # [r, in_features]
    B: torch.Tensor  # [out_features, r]
    scale: float


@dataclass(frozen=True)
class RemoteFiles:
    """A remote adapter's two files as registered: their URIs, sizes and versions."""

    config: RemoteObject
    weights: RemoteObject

    @property
    def version(self) -> str:
        return f"{self.weights.version}|{self.config.version}"


@dataclass(frozen=True)
class AdapterSpec:
    adapter_id: str
    path: Path | str  # resolved adapter folder, or a remote adapter's normalized URI
    weights_file: Path | None  # resolved adapter_model.safetensors (None: remote)
    rank: int  # max rank over modules
    target_modules: frozenset[str]  # short names, e.g. "q_proj"
    module_ranks: Mapping[str, int]  # module path -> r
    module_scales: Mapping[str, float]  # module path -> lora_alpha / r (or / sqrt(r) with rslora)
    module_shapes: Mapping[str, tuple[int, int]]  # module path -> (in_features, out_features)
    nbytes: int  # size of the safetensors file
    base_model_name_or_path: str | None  # from adapter_config.json, informational only
    remote: RemoteFiles | None = None  # where a remote adapter's files are, and their versions at registration


class AdapterRegistry:
    """adapter_id -> AdapterSpec. Read by the engine thread, written by API calls, hence the lock.

    Roots are local folders or URI prefixes (s3://, gs://, hf://, http(s)://; app/adapters/remote.py). A remote
    adapter is validated at registration from ranged reads of its config and safetensors header; its bytes come
    through `cache`, the node's disk cache, when it is first read (`read`) or fetched ahead (`fetch_ahead`).
    Without a cache (the ingress's validator) remote adapters can be validated but not read.
    """

    def __init__(
        self,
        roots: Sequence[str | Path],
        base_config: PretrainedConfig,
        max_rank: int,
        max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
        supported_targets: Sequence[str] = TARGET_NAMES,
        *,
        cache: NodeCache | None = None,
        fetch_workers: int = 8,
        fetch_timeout_s: float = 60.0,
    ):
        if not roots:
            raise ValueError("at least one adapter root is required")
        if max_rank < 1:
            raise ValueError(f"max_rank ({max_rank}) must be >= 1")
        if max_adapter_bytes < 1:
            raise ValueError(f"max_adapter_bytes ({max_adapter_bytes}) must be >= 1")
        unknown = set(supported_targets) - set(TARGET_NAMES)
        if unknown:
            raise ValueError(f"supported_targets {sorted(unknown)} are not among {list(TARGET_NAMES)}")
        remote_roots = [str(root) for root in roots if is_remote(root)]
        self.roots = tuple(Path(root).expanduser().resolve(strict=True) for root in roots if not is_remote(root))
        self.store = RemoteStore(remote_roots, fetch_timeout_s, fetch_workers) if remote_roots else None
        self.cache = cache
        self._roots = [str(root) for root in self.roots] + remote_roots  # for messages
        self._fetches = ThreadPoolExecutor(max_workers=fetch_workers, thread_name_prefix="adapter-fetch")
        self._fetching: set[CacheKey] = set()
        self._on_node: set[CacheKey] = set()  # copies this replica has seen on the node (see _held)
        # (URI, registered version) -> a newer version of its files, fetched and validated since
        self._newer: dict[tuple[str, str], RemoteFiles] = {}
        self._ahead = {"fetched_ahead": 0, "fetched_ahead_bytes": 0, "fetched_ahead_used": 0,
                       "fetched_ahead_used_bytes": 0}
        self._unused_ahead: dict[CacheKey, int] = {}  # fetched ahead, not read since: key -> bytes
        self.max_rank = max_rank
        self.max_adapter_bytes = max_adapter_bytes
        # Only the base's own targets: an adapter for another architecture's names is refused by name.
        self.supported_targets = frozenset(supported_targets) & frozenset(target_names(base_config))
        self.num_layers = base_config.num_hidden_layers
        self.base_shapes = {
            module: shape
            for module, shape in target_shapes(base_config).items()
            if short_name(module) in self.supported_targets
        }
        self._lock = threading.Lock()
        self._adapter_id_to_spec: dict[str, AdapterSpec] = {}

    def register(self, adapter_id: str, path: str | Path) -> AdapterSpec:
        spec = self.validate(adapter_id, path)  # outside the lock: it reads the file
        with self._lock:
            if adapter_id in self._adapter_id_to_spec:
                raise AdapterAlreadyExists(f"adapter '{adapter_id}' is already registered; unregister it first")
            self._adapter_id_to_spec[adapter_id] = spec
        return spec

    def unregister(self, adapter_id: str) -> AdapterSpec:
        with self._lock:
            self._check_registered(adapter_id)
            return self._adapter_id_to_spec.pop(adapter_id)

    def get(self, adapter_id: str) -> AdapterSpec:
        with self._lock:
            self._check_registered(adapter_id)
            return self._adapter_id_to_spec[adapter_id]

    def _check_registered(self, adapter_id: str) -> None:  # caller holds the lock
        if adapter_id not in self._adapter_id_to_spec:
            count = len(self._adapter_id_to_spec)
            raise AdapterNotFound(f"adapter '{adapter_id}' is not registered ({count} adapters are)")

    def __contains__(self, adapter_id: object) -> bool:
        with self._lock:
            return adapter_id in self._adapter_id_to_spec

    def list(self) -> list[AdapterSpec]:
        with self._lock:
            return [self._adapter_id_to_spec[k] for k in sorted(self._adapter_id_to_spec)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._adapter_id_to_spec)

    def validate(self, adapter_id: str, path: str | Path) -> AdapterSpec:
        """Check the adapter completely and return its spec. Changes no state."""
        adapter_id = validate_adapter_id(adapter_id)
        uri = self._remote_uri(adapter_id, path)
        if uri is not None:
            return self._validate_remote(adapter_id, uri)
        return self._validate_local(adapter_id, path)

    def _remote_uri(self, adapter_id: str, path: str | Path) -> str | None:
        """The URI `path` names: itself, or a bare name's folder under the first remote root that has it where no
        local root does. None: a local path."""
        if is_remote(path):
            if self.store is None:
                raise AdapterPathOutsideRoots(f"adapter '{adapter_id}': {path} is remote, and no adapter root is "
                                              f"(roots: {self._roots})")
            return self.store.resolve(adapter_id, str(path))
        name = str(path)
        if self.store is None or "/" in name or "\0" in name or name in ("", ".", "..") or any(
                (root / name).exists() for root in self.roots):
            return None
        for candidate in self.store.under_roots(name):
            try:
                self.store.stat(f"{self.store.resolve(adapter_id, candidate)}/{CONFIG_NAME}")
                return self.store.resolve(adapter_id, candidate)
            except AdapterSourceMissing:
                continue
        return None

    def _validate_local(self, adapter_id: str, path: str | Path) -> AdapterSpec:
        try:
            folder = self._resolve_folder(adapter_id, path)
            weights_file, config_file = self._find_files(adapter_id, folder)
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot read its files: {e}") from e
        return self._validate_files(adapter_id, folder, weights_file, config_file)

    def _validate_files(self, adapter_id: str, folder: Path, weights_file: Path, config_file: Path) -> AdapterSpec:
        try:
            nbytes = weights_file.stat().st_size
        except OSError as e:
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot read its files: {e}") from e
        if nbytes > self.max_adapter_bytes:
            raise AdapterTooLarge(
                f"adapter '{adapter_id}': {WEIGHTS_NAME} is {nbytes} bytes > max_adapter_bytes {self.max_adapter_bytes}"
            )
        config = read_config(adapter_id, config_file)
        try:
            with open(weights_file, "rb") as f:
                header = read_header(adapter_id, f)
                spec = self._spec(adapter_id, folder, header, config, nbytes, weights_file=weights_file)
                check_finite_on_disk(adapter_id, f, header)  # last: the only step that reads the data
        except OSError as e:
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot read {WEIGHTS_NAME}: {e.strerror or e}") from e
        return spec

    def _validate_remote(self, adapter_id: str, uri: str) -> AdapterSpec:
        """The checks of a local folder, from the config and the safetensors header alone (a few ranged reads);
        the NaN/Inf and bound checks run when the weights arrive (the residency's bound check, or `read`)."""
        try:
            return self._check_remote(adapter_id, uri)
        except (AdapterSourceMissing, AdapterSourceDenied, AdapterStoreUnavailable) as e:
            raise type(e)(f"adapter '{adapter_id}': {e.message}", retry_after_s=e.retry_after_s) from e

    def _check_remote(self, adapter_id: str, uri: str) -> AdapterSpec:
        weights_object = self._stat_remote(adapter_id, uri, WEIGHTS_NAME)
        config_object = self._stat_remote(adapter_id, uri, CONFIG_NAME)
        if weights_object.size > self.max_adapter_bytes:
            raise AdapterTooLarge(f"adapter '{adapter_id}': {weights_object.uri} is {weights_object.size} bytes > "
                                  f"max_adapter_bytes {self.max_adapter_bytes}")
        if config_object.size > _MAX_CONFIG_BYTES:  # before reading it
            raise AdapterFormatError(f"adapter '{adapter_id}': {config_object.uri} is {config_object.size} bytes; "
                                     f"at most {_MAX_CONFIG_BYTES} are read")
        config_bytes = self.store.read_all(config_object.uri, _MAX_CONFIG_BYTES)
        with tempfile.TemporaryDirectory() as scratch:  # PEFT parses configs from files
            config_file = Path(scratch) / CONFIG_NAME
            config_file.write_bytes(config_bytes)
            config = read_config(adapter_id, config_file)
        header = read_header(adapter_id, _RangedReader(self.store, weights_object.uri), weights_object.size)
        return self._spec(adapter_id, uri, header, config, weights_object.size,
                          remote=RemoteFiles(config_object, weights_object))

    def _stat_remote(self, adapter_id: str, uri: str, name: str) -> RemoteObject:
        """One file of a remote folder; missing from a folder that exists, it is refused as `_find_files` refuses
        it locally (a missing folder stays AdapterSourceMissing)."""
        try:
            return self.store.stat(f"{uri}/{name}")
        except AdapterSourceMissing:
            present = self.store.names(uri)
            if not present:
                raise
        pickles = [n for n in present if n.endswith(PICKLE_SUFFIXES)]
        if name == WEIGHTS_NAME and pickles:
            raise AdapterFormatError(
                f"adapter '{adapter_id}': pickle weights {pickles} are refused (loading them can run code); "
                f"re-save with save_pretrained(..., safe_serialization=True) to get {WEIGHTS_NAME}")
        raise AdapterFormatError(f"adapter '{adapter_id}': {uri} has no {name}")

    def _spec(self, adapter_id: str, path: Path | str, header: AdapterHeader, config, nbytes: int,
              weights_file: Path | None = None, remote: RemoteFiles | None = None) -> AdapterSpec:
        """The spec from a checked header and config: modules, ranks and scales against the base model."""
        modules = check_modules(adapter_id, header.entries, self.supported_targets, self.base_shapes, self.num_layers)
        module_ranks = {module: header.entries[a].shape[0] for module, (a, _) in modules.items()}
        rank = max(module_ranks.values())
        if rank > self.max_rank:
            raise AdapterRankTooHigh(
                f"adapter '{adapter_id}': rank {rank} > max_rank {self.max_rank} (set max_rank >= {rank})"
            )
        module_scales = check_config_matches(adapter_id, config, module_ranks, self.base_shapes)
        return AdapterSpec(
            adapter_id=adapter_id,
            path=path,
            weights_file=weights_file,
            rank=rank,
            target_modules=frozenset(short_name(module) for module in modules),
            module_ranks=MappingProxyType(module_ranks),
            module_scales=MappingProxyType(module_scales),
            module_shapes=MappingProxyType({module: self.base_shapes[module] for module in modules}),
            nbytes=nbytes,
            base_model_name_or_path=config.base_model_name_or_path,
            remote=remote,
        )

    # --- reading remote adapters through the node cache ---------------------------------------------

    def read(self, spec: AdapterSpec, check_finite: bool = False) -> StoredAdapter:
        """The adapter's file, read again (`read_adapter`); a remote one from the node cache, fetched first
        where the node does not hold it. Worker threads."""
        if spec.remote is None:
            return read_adapter(spec, check_finite)
        with self._fetched(spec) as local:
            key = self._cache_key(spec)
            with self._lock:
                if (nbytes := self._unused_ahead.pop(key, None)) is not None:
                    self._ahead["fetched_ahead_used"] += 1
                    self._ahead["fetched_ahead_used_bytes"] += nbytes
            return read_adapter(local, check_finite)

    def fetch_ahead(self, adapter_ids: Sequence[str]) -> int:
        """Start fetching remote adapters into the node cache, nearest need first (`adapter_ids` in the order
        their requests should be served; local adapters are skipped). Only while the remote adapters named so
        far fit in half the cache: a fetch for a request far back must not evict an adapter that a nearer one
        needs. Returns how many fetches started. Never blocks and never raises: a failed fetch is logged, and
        the request that needs the adapter meets the fault when its own read repeats it."""
        if self.cache is None or self.store is None:
            return 0
        room, started = self.cache.budget_bytes // 2, 0
        for adapter_id in dict.fromkeys(adapter_ids):
            with self._lock:
                spec = self._adapter_id_to_spec.get(adapter_id)
            if spec is None or spec.remote is None:
                continue
            room -= spec.nbytes
            if room < 0:
                break
            key = self._cache_key(spec)
            with self._lock:
                if key in self._fetching or self._held(key):
                    continue
                self._fetching.add(key)
            self._fetches.submit(self._fetch_one, spec, key)
            started += 1
        return started

    def _fetch_one(self, spec: AdapterSpec, key: CacheKey) -> None:
        def downloaded(nbytes: int) -> None:  # before the entry is visible: no read can come first
            with self._lock:
                self._ahead["fetched_ahead"] += 1
                self._ahead["fetched_ahead_bytes"] += nbytes
                self._unused_ahead[key] = nbytes

        try:
            with self._fetched(spec, downloaded):
                pass
        except Exception as e:  # noqa: BLE001 - logged here; the request's own read raises it to its client
            log.warning("fetching adapter %r ahead failed: %s", spec.adapter_id, e)
        finally:
            with self._lock:
                self._fetching.discard(key)

    def node_snapshot(self) -> dict:
        """The node cache's counters and this replica's fetches ahead: started, and used by a read since."""
        with self._lock:
            ahead = dict(self._ahead)
        return {**self.cache.snapshot(), **ahead, "fetches_running": len(self._fetching)}

    def on_node(self, adapter_id: str) -> bool:
        """Whether reading the adapter needs no remote fetch (local adapters: always)."""
        with self._lock:
            spec = self._adapter_id_to_spec.get(adapter_id)
        return spec is None or self.is_cached(spec)

    def is_cached(self, spec: AdapterSpec) -> bool:
        """Whether the node holds the adapter's files (local adapters always are)."""
        if spec.remote is None:
            return True
        return self.cache is not None and self._held(self._cache_key(spec))

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
    def _fetched(self, spec: AdapterSpec, downloaded: Callable[[int], None] | None = None) -> Iterator[AdapterSpec]:
        """The spec of the adapter's copy in the node cache, held there for the block. On a miss, the store is
        asked first whether the object is still the one registered; if it changed, the new bytes are fetched
        and validated against the registration before anything reads them. `downloaded(nbytes)` is called when
        this call is the one that downloads it, before the copy becomes visible."""
        if self.cache is None:
            raise AdapterLoadFailed(f"adapter '{spec.adapter_id}': remote adapters need a node cache "
                                    "(adapter_cache_dir)")
        registered = (str(spec.path), spec.remote.version)
        files = self._newer.get(registered, spec.remote)
        if not self.cache.contains(CacheKey(str(spec.path), files.version)):
            current = RemoteFiles(self.store.stat(files.config.uri), self.store.stat(files.weights.uri))
            if current.version != files.version:
                log.info("adapter %r changed in its store since registration; validating the new version",
                         spec.adapter_id)
            files = current
        changed = files.version != spec.remote.version
        nbytes = files.config.size + files.weights.size

        def fill(folder: Path) -> None:
            for obj, name in ((files.config, CONFIG_NAME), (files.weights, WEIGHTS_NAME)):
                self.store.download(obj, folder / name)
            if changed:  # before the rename makes it visible to anyone
                try:
                    now = self._validate_files(spec.adapter_id, folder, folder / WEIGHTS_NAME, folder / CONFIG_NAME)
                except AdapterInvalid as e:  # a read fails as `read_adapter` fails: AdapterLoadFailed
                    raise AdapterLoadFailed(f"{e.message} (its new version in the store; re-register it)") from e
                self._check_same(spec, now)
            if downloaded is not None:
                downloaded(nbytes)

        with self.cache.entry(CacheKey(str(spec.path), files.version), nbytes, fill) as folder:
            with self._lock:
                self._on_node.add(CacheKey(str(spec.path), files.version))
                if changed:  # validated: later reads go to this version's copy without asking the store again
                    self._newer[registered] = files
            yield replace(spec, path=folder, weights_file=folder / WEIGHTS_NAME, nbytes=files.weights.size,
                          remote=None)

    def _check_same(self, registered: AdapterSpec, now: AdapterSpec) -> None:
        for field in ("module_ranks", "module_scales", "module_shapes"):
            if dict(getattr(registered, field)) != dict(getattr(now, field)):
                raise AdapterLoadFailed(
                    f"adapter '{registered.adapter_id}': {registered.path} changed in its store since registration, "
                    f"and its {field.removeprefix('module_')} no longer match; re-register it")

    def shutdown(self) -> None:
        self._fetches.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.shutdown()

    def _resolve_folder(self, adapter_id: str, path: str | Path) -> Path:
        try:
            candidate = Path(path).expanduser()
        except RuntimeError as e:  # "~user" of no such user, or no home directory
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot expand {str(path)!r}: {e}") from e
        if not candidate.is_absolute() and not candidate.exists():
            under_roots = [root / candidate for root in self.roots]
            if not under_roots:  # remote roots only, and `_remote_uri` found it under none of them
                raise AdapterFormatError(f"adapter '{adapter_id}': no such directory {str(path)!r} under {self._roots}")
            candidate = next((p for p in under_roots if p.exists()), under_roots[0])
        folder = self._inside_roots(adapter_id, candidate, "folder")
        if not folder.is_dir():
            raise AdapterFormatError(f"adapter '{adapter_id}': no such directory {str(path)!r} under {self._roots}")
        return folder

    def _find_files(self, adapter_id: str, folder: Path) -> tuple[Path, Path]:
        weights_file = self._inside_roots(adapter_id, folder / WEIGHTS_NAME, WEIGHTS_NAME)
        if not weights_file.is_file():
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise AdapterFormatError(
                    f"adapter '{adapter_id}': pickle weights {pickles} are refused (loading them can run code); "
                    f"re-save with save_pretrained(..., safe_serialization=True) to get {WEIGHTS_NAME}"
                )
            raise AdapterFormatError(f"adapter '{adapter_id}': {folder} has no {WEIGHTS_NAME}")
        config_file = self._inside_roots(adapter_id, folder / CONFIG_NAME, CONFIG_NAME)
        if not config_file.is_file():
            raise AdapterFormatError(f"adapter '{adapter_id}': {folder} has no {CONFIG_NAME}")
        return weights_file, config_file

    def _inside_roots(self, adapter_id: str, path: Path, what: str) -> Path:
        # Containment is judged on the resolved path before any existence check, so a client cannot use
        # "no such directory" answers to probe the file system outside the roots.
        try:
            resolved = path.resolve()
        except RuntimeError as e:  # symlink loop
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot resolve {path}: {e}") from e
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise AdapterPathOutsideRoots(
                f"adapter '{adapter_id}': {what} resolves to {resolved}, outside the adapter roots {self._roots}"
            )
        return resolved


class _RangedReader:
    """Sequential `read` over ranged reads of a remote file: enough for `read_header`."""

    def __init__(self, store: RemoteStore, uri: str):
        self.store, self.uri, self.position = store, uri, 0

    def read(self, n: int) -> bytes:
        data = self.store.read(self.uri, self.position, self.position + n)
        self.position += len(data)
        return data


@dataclass(frozen=True)
class StoredAdapter:
    """An adapter file read again at load time and checked against its registration."""

    spec: AdapterSpec
    file: AdapterFile
    modules: Mapping[str, tuple[str, str]]  # module path -> (key of A [r, in], key of B [out, r])

    def flat_parts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int, float]]:
        """module path -> (A as 1-D [r * in], B as 1-D row-major [out * r], r, scale): what SlotLayout.pack takes.

        Only slicing, which keeps the GIL (see AdapterFile)."""
        return {
            module: (self.file.flat(a), self.file.flat(b), self.spec.module_ranks[module], self.spec.module_scales[module])
            for module, (a, b) in self.modules.items()
        }


def read_adapter(spec: AdapterSpec, check_finite: bool = False) -> StoredAdapter:
    """Read the adapter's file again, since files may change or vanish after registration. Any failure
    raises AdapterLoadFailed. check_finite=False skips the NaN/Inf scan, for callers that bound-check the
    packed result anyway (the engine)."""
    path = spec.weights_file
    try:
        nbytes = path.stat().st_size
        if nbytes != spec.nbytes or path.resolve(strict=True) != path:
            raise AdapterLoadFailed(
                f"adapter '{spec.adapter_id}': {path} was changed or replaced since registration "
                f"({spec.nbytes} bytes then, {nbytes} now); re-register it"
            )
        file, modules = read_modules(spec.adapter_id, path, spec.target_modules, spec.module_shapes, None,
                                     check_finite)
    except OSError as e:
        raise AdapterLoadFailed(f"adapter '{spec.adapter_id}': cannot read {path}: {e.strerror or e}") from e
    except AdapterInvalid as e:
        raise AdapterLoadFailed(f"{e.message} (while loading {path}; re-register it)") from e
    module_ranks = {module: file.entries[a].shape[0] for module, (a, _) in modules.items()}
    if module_ranks != dict(spec.module_ranks):
        raise AdapterLoadFailed(
            f"adapter '{spec.adapter_id}': modules or ranks in {path} changed since registration; re-register it"
        )
    return StoredAdapter(spec, file, modules)


def load_weights(spec: AdapterSpec, dtype: torch.dtype | None = None, check_finite: bool = True
                 ) -> dict[str, LoRAWeights]:
    """module path -> LoRAWeights (shaped tensors, cast to dtype), read as `read_adapter` reads."""
    stored = read_adapter(spec, check_finite)
    weights = {}
    for module, (a, b) in stored.modules.items():
        A, B = stored.file.tensor(a), stored.file.tensor(b)
        weights[module] = LoRAWeights(A=A if dtype is None else A.to(dtype), B=B if dtype is None else B.to(dtype),
                                      scale=spec.module_scales[module])
    return weights
