"""Adapter registry: checks a PEFT LoRA folder against the base model once, then serves its spec by id.

Registration checks the header against the base model first, then streams every value through the NaN/Inf
check in bounded chunks, so a bad adapter is refused before any request uses it and a large file never sits
in memory. A remote adapter (app/adapters/remote.py) is checked from its config and header alone; its weights
come through the node cache (app/adapters/fetcher.py). `read` reads the file again at load time
(app/adapters/spec.py), because files may change or vanish after registration.
"""

from __future__ import annotations

import re
import tempfile
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

from transformers import PretrainedConfig

from app.adapters.fetcher import RemoteFetcher
from app.adapters.format import (
    CONFIG_NAME,
    PICKLE_SUFFIXES,
    check_config_matches,
    check_modules,
    read_config,
    short_name,
)
from app.adapters.node_cache import NodeCache
from app.adapters.remote import RemoteObject, RemoteStore
from app.adapters.uris import is_remote
from app.adapters.safetensors_file import WEIGHTS_NAME, AdapterHeader, check_finite_on_disk, read_header
from app.adapters.spec import AdapterSpec, RemoteFiles, StoredAdapter, read_adapter
from app.adapters.targets import TARGET_NAMES, target_names, target_shapes
from app.errors import (
    AdapterAlreadyExists,
    AdapterFormatError,
    AdapterInvalid,
    AdapterNotFound,
    AdapterPathOutsideRoots,
    AdapterRankTooHigh,
    AdapterSourceDenied,
    AdapterSourceMissing,
    AdapterStoreUnavailable,
    AdapterTooLarge,
)
from prefetch.threads import one_cpu_thread

DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3
_MAX_CONFIG_BYTES = 1024 * 1024
# A remote weights file's first bytes, read with the registration's other requests: the header's size and, for
# adapters of up to several thousand tensors, the whole header.
_HEAD_BYTES = 256 * 1024
VALIDATIONS_AT_ONCE = 16  # remote registrations whose reads run at once (a replica syncs 16 at a time)
_ADAPTER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is a safe name (it ends up in URLs, logs and metrics labels)."""
    if not isinstance(adapter_id, str) or not _ADAPTER_ID_RE.fullmatch(adapter_id) or ".." in adapter_id:
        raise AdapterInvalid(
            f"invalid adapter id {adapter_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'"
        )
    return adapter_id


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
        self.fetcher = RemoteFetcher(self.store, cache, fetch_workers, self._validate_files) if self.store else None
        self._validation_reads = ThreadPoolExecutor(max_workers=4 * VALIDATIONS_AT_ONCE,
                                                    thread_name_prefix="adapter-validate",
                                                    initializer=one_cpu_thread) if self.store else None
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
        except (AdapterSourceMissing, AdapterSourceDenied, AdapterStoreUnavailable, AdapterPathOutsideRoots) as e:
            raise type(e)(f"adapter '{adapter_id}': {e.message}", retry_after_s=e.retry_after_s) from e

    def _check_remote(self, adapter_id: str, uri: str) -> AdapterSpec:
        # The four reads go out at once, so that a registration waits one round trip to the store instead of five
        # (stat both files, read the config, read the header's size, read the header); the checks then run in
        # the order a local folder's do, so a fault is reported as it would be there.
        reads = self._validation_reads
        weights_stat = reads.submit(self._stat_remote, adapter_id, uri, WEIGHTS_NAME)
        config_stat = reads.submit(self._stat_remote, adapter_id, uri, CONFIG_NAME)
        head = reads.submit(self.store.read, f"{uri}/{WEIGHTS_NAME}", 0, _HEAD_BYTES)
        config_read = reads.submit(self.store.read, f"{uri}/{CONFIG_NAME}", 0, _MAX_CONFIG_BYTES + 1)
        weights_object, config_object = weights_stat.result(), config_stat.result()
        if weights_object.size > self.max_adapter_bytes:
            raise AdapterTooLarge(f"adapter '{adapter_id}': {weights_object.uri} is {weights_object.size} bytes > "
                                  f"max_adapter_bytes {self.max_adapter_bytes}")
        config_bytes = config_read.result() if config_object.size else b""  # a store refuses ranges of nothing
        if config_object.size > _MAX_CONFIG_BYTES or len(config_bytes) > _MAX_CONFIG_BYTES:
            raise AdapterFormatError(f"adapter '{adapter_id}': {config_object.uri} is {config_object.size} bytes; "
                                     f"at most {_MAX_CONFIG_BYTES} are read")
        with tempfile.TemporaryDirectory() as scratch:  # PEFT parses configs from files
            config_file = Path(scratch) / CONFIG_NAME
            config_file.write_bytes(config_bytes)
            config = read_config(adapter_id, config_file)
        reader = _RangedReader(self.store, weights_object.uri, head.result() if weights_object.size else b"")
        try:
            header = read_header(adapter_id, reader, weights_object.size)
        except AdapterFormatError:
            # The stat and the reads went out at once: bytes that do not fit the size stat'ed may be another
            # version's, which is not a malformed file.
            self.store.check_unchanged(weights_object)
            raise
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
            raise pickle_refused(adapter_id, pickles)
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

    # --- reading adapters (remote ones through the node cache: app/adapters/fetcher.py) ----------------

    def read(self, spec: AdapterSpec, check_finite: bool = False) -> StoredAdapter:
        """The adapter's file, read again (`read_adapter`); a remote one from the node cache, fetched first
        where the node does not hold it. Worker threads."""
        if spec.remote is None:
            return read_adapter(spec, check_finite)
        return self.fetcher.read(spec, check_finite)

    def fetch_ahead(self, adapter_ids: Sequence[str], urgent: Collection[str] = ()) -> int:
        """Start fetching remote adapters into the node cache, nearest need first (`adapter_ids` in the order
        their requests should be served; local adapters are skipped); `urgent`: those of requests already here.
        See RemoteFetcher.fetch_ahead."""
        if self.fetcher is None:
            return 0
        with self._lock:
            specs = [self._adapter_id_to_spec.get(adapter_id) for adapter_id in dict.fromkeys(adapter_ids)]
        return self.fetcher.fetch_ahead([spec for spec in specs if spec is not None and spec.remote is not None],
                                        urgent)

    def is_fetching(self, adapter_id: str) -> bool:
        """Whether a fetch of the remote adapter into the node cache is under way."""
        with self._lock:
            spec = self._adapter_id_to_spec.get(adapter_id)
        return spec is not None and spec.remote is not None and self.fetcher is not None and \
            self.fetcher.is_fetching(spec)

    def node_snapshot(self) -> dict:
        """The node cache's counters and this replica's fetches ahead: started, and used by a read since (only
        where the registry has a node cache, which comes with its fetcher)."""
        return self.fetcher.snapshot()

    def on_node(self, adapter_id: str) -> bool:
        """Whether reading the adapter needs no remote fetch (local adapters: always)."""
        with self._lock:
            spec = self._adapter_id_to_spec.get(adapter_id)
        return spec is None or self.is_cached(spec)

    def is_cached(self, spec: AdapterSpec) -> bool:
        """Whether the node holds the adapter's files (local adapters always are)."""
        return spec.remote is None or self.fetcher is not None and self.fetcher.is_cached(spec)

    def shutdown(self) -> None:
        if self.fetcher is not None:
            self.fetcher.shutdown()
            self._validation_reads.shutdown(wait=False, cancel_futures=True)
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
                raise pickle_refused(adapter_id, pickles)
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
    """Sequential `read` over a remote file's first bytes, read already, then ranged reads beyond them: enough for
    `read_header`."""

    def __init__(self, store: RemoteStore, uri: str, head: bytes = b""):
        self.store, self.uri, self.head, self.position = store, uri, head, 0

    def read(self, n: int) -> bytes:
        end = self.position + n
        data = self.head[self.position:end]
        if len(data) < n and len(self.head) == _HEAD_BYTES:  # the head was cut short of the file's end
            data += self.store.read(self.uri, self.position + len(data), end)
        self.position += len(data)
        return data


def pickle_refused(adapter_id: str, pickles: list[str]) -> AdapterFormatError:
    return AdapterFormatError(
        f"adapter '{adapter_id}': pickle weights {pickles} are refused (loading them can run code); "
        f"re-save with save_pretrained(..., safe_serialization=True) to get {WEIGHTS_NAME}")
