"""Adapter registry: checks a PEFT LoRA folder against the base model once, then serves its spec by id.

Registration checks the header against the base model first, then streams every value through the NaN/Inf
check in bounded chunks, so a bad adapter is refused before any request uses it and a large file never sits
in memory. `read_adapter` reads the file again at load time, because files may change or vanish after
registration.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
from app.adapters.safetensors_file import WEIGHTS_NAME, AdapterFile, check_finite_on_disk, read_header
from app.errors import (
    AdapterAlreadyExists,
    AdapterFormatError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterPathOutsideRoots,
    AdapterRankTooHigh,
    AdapterTooLarge,
)
from app.adapters.targets import TARGET_NAMES, target_names, target_shapes

DEFAULT_MAX_ADAPTER_BYTES = 2 * 1024**3
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
class AdapterSpec:
    adapter_id: str
    path: Path  # resolved adapter folder
    weights_file: Path  # resolved adapter_model.safetensors
    rank: int  # max rank over modules
    target_modules: frozenset[str]  # short names, e.g. "q_proj"
    module_ranks: Mapping[str, int]  # module path -> r
    module_scales: Mapping[str, float]  # module path -> lora_alpha / r (or / sqrt(r) with rslora)
    module_shapes: Mapping[str, tuple[int, int]]  # module path -> (in_features, out_features)
    nbytes: int  # size of the safetensors file
    base_model_name_or_path: str | None  # from adapter_config.json, informational only


class AdapterRegistry:
    """adapter_id -> AdapterSpec. Read by the engine thread, written by API calls, hence the lock."""

    def __init__(
        self,
        roots: Sequence[str | Path],
        base_config: PretrainedConfig,
        max_rank: int,
        max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
        supported_targets: Sequence[str] = TARGET_NAMES,
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
        self.roots = tuple(Path(root).expanduser().resolve(strict=True) for root in roots)
        self._roots = [str(root) for root in self.roots]  # for messages
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
        """Check the adapter folder completely and return its spec. Changes no state."""
        adapter_id = validate_adapter_id(adapter_id)
        try:
            folder = self._resolve_folder(adapter_id, path)
            weights_file, config_file = self._find_files(adapter_id, folder)
            nbytes = weights_file.stat().st_size
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot read its files: {e}") from e
        if nbytes > self.max_adapter_bytes:
            raise AdapterTooLarge(
                f"adapter '{adapter_id}': {WEIGHTS_NAME} is {nbytes} bytes > max_adapter_bytes {self.max_adapter_bytes}"
            )
        config = read_config(adapter_id, config_file)
        try:
            with open(weights_file, "rb") as f:
                header = read_header(adapter_id, f)
                modules = check_modules(adapter_id, header.entries, self.supported_targets, self.base_shapes,
                                        self.num_layers)
                module_ranks = {module: header.entries[a].shape[0] for module, (a, _) in modules.items()}
                rank = max(module_ranks.values())
                if rank > self.max_rank:
                    raise AdapterRankTooHigh(
                        f"adapter '{adapter_id}': rank {rank} > max_rank {self.max_rank} (set max_rank >= {rank})"
                    )
                module_scales = check_config_matches(adapter_id, config, module_ranks, self.base_shapes)
                check_finite_on_disk(adapter_id, f, header)  # last: the only step that reads the data
        except OSError as e:
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot read {WEIGHTS_NAME}: {e.strerror or e}") from e
        return AdapterSpec(
            adapter_id=adapter_id,
            path=folder,
            weights_file=weights_file,
            rank=rank,
            target_modules=frozenset(short_name(module) for module in modules),
            module_ranks=MappingProxyType(module_ranks),
            module_scales=MappingProxyType(module_scales),
            module_shapes=MappingProxyType({module: self.base_shapes[module] for module in modules}),
            nbytes=nbytes,
            base_model_name_or_path=config.base_model_name_or_path,
        )

    def _resolve_folder(self, adapter_id: str, path: str | Path) -> Path:
        try:
            candidate = Path(path).expanduser()
        except RuntimeError as e:  # "~user" of no such user, or no home directory
            raise AdapterFormatError(f"adapter '{adapter_id}': cannot expand {str(path)!r}: {e}") from e
        if not candidate.is_absolute() and not candidate.exists():
            under_roots = [root / candidate for root in self.roots]
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
