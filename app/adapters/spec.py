"""What the registry knows of an adapter (AdapterSpec), and its file read again at load time (read_adapter).

A spec is made once, at registration; the file is read again whenever the adapter is loaded, because files may
change or vanish after registration, and the read is checked against the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from app.adapters.format import read_modules
from app.adapters.remote import RemoteObject
from app.adapters.safetensors_file import AdapterFile
from app.errors import AdapterInvalid, AdapterLoadFailed


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


def read_adapter(spec: AdapterSpec, check_finite: bool = False, fix: str = "re-register it") -> StoredAdapter:
    """Read the adapter's file again, since files may change or vanish after registration. Any failure
    raises AdapterLoadFailed, whose message ends with `fix`: what recovers. check_finite=False skips the NaN/Inf
    scan, for callers that bound-check the packed result anyway (the engine)."""
    path = spec.weights_file
    try:
        nbytes = path.stat().st_size
        if nbytes != spec.nbytes or path.resolve(strict=True) != path:
            raise AdapterLoadFailed(
                f"adapter '{spec.adapter_id}': {path} was changed or replaced since registration "
                f"({spec.nbytes} bytes then, {nbytes} now); {fix}"
            )
        file, modules = read_modules(spec.adapter_id, path, spec.target_modules, spec.module_shapes, None,
                                     check_finite)
    except OSError as e:
        raise AdapterLoadFailed(f"adapter '{spec.adapter_id}': cannot read {path}: {e.strerror or e}") from e
    except AdapterInvalid as e:
        raise AdapterLoadFailed(f"{e.message} (while loading {path}; {fix})") from e
    module_ranks = {module: file.entries[a].shape[0] for module, (a, _) in modules.items()}
    if module_ranks != dict(spec.module_ranks):
        raise AdapterLoadFailed(
            f"adapter '{spec.adapter_id}': modules or ranks in {path} changed since registration; {fix}"
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
