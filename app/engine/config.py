"""Engine configuration: a frozen dataclass that validates itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.adapters.targets import TARGET_NAMES

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    base_model: str
    adapter_roots: tuple[str, ...] = ()
    # Device adapter memory, in pages of `adapter_page_rows` rank rows (an adapter takes the pages its rank
    # needs). num_slots: exactly that many adapters, each given a max_rank adapter's pages (an override);
    # else adapter_memory_bytes; else adapter_memory_fraction of the GPU memory free after the weights
    # (CPU: 8 max_rank adapters' worth).
    num_slots: int | None = None
    adapter_memory_bytes: int | None = None
    adapter_memory_fraction: float = 0.2
    adapter_page_rows: int = 4
    max_rank: int = 16  # largest adapter rank
    target_modules: tuple[str, ...] = TARGET_NAMES  # the names adapters may target, where the base has them
    host_cache_bytes: int = 2 * GiB
    max_adapter_bytes: int = 2 * GiB
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    max_batch_size: int = 32
    max_input_tokens: int = 2048
    max_total_tokens: int = 65536  # KV cache capacity in tokens where kv_cache_bytes and the GPU do not set it
    kv_cache_bytes: int | None = None  # KV cache size; None: kv_cache_memory_fraction of free GPU memory (CPU: max_total_tokens)
    kv_cache_memory_fraction: float = 0.85  # of the GPU memory free after the weights and adapter pool
    block_size: int = 16  # tokens per KV cache block
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    compile_decode: bool = True  # torch.compile the decoder before capturing the decode graphs (CUDA only)
    max_graph_tokens: int = 512  # steps of up to this many tokens that prefill replay graphs (<= max_batch_size: none)
    max_queue: int = 1024
    # Prefill tokens per step; longer prompts are chunked. None: what a full batch of decode rows leaves of
    # max_graph_tokens, so that steps that prefill replay a graph (2048 where that leaves under 64).
    max_prefill_tokens_per_step: int | None = None
    prefetch: bool = True  # False: adapters load synchronously when a request needs them
    max_inflight_loads: int = 2
    hint_ttl_s: float = 30.0
    disk_workers: int = 2
    # Remote adapters (s3://, gs://, hf://, http(s):// roots): the node's disk cache, shared by its replicas, and
    # the fetches into it. None: $XDG_CACHE_HOME/lora-serve/adapters (else ~/.cache/lora-serve/adapters).
    adapter_cache_dir: str | None = None
    adapter_cache_bytes: int = 32 * GiB
    adapter_fetch_workers: int = 8  # adapters fetched ahead at once (as many for queued ones), and ranges at once
    adapter_fetch_timeout_s: float = 60.0  # one store call's limit; a store that hangs fails with a 503
    # Diagnostics: sample where the engine thread is while a host part of its loop runs longer than this many ms
    # (app/engine/stall_sampler.py; reported in step_timing's "stalls"). 0: off.
    sample_stalls_ms: float = 0.0

    def __post_init__(self):
        if self.max_prefill_tokens_per_step is None:
            room = self.max_graph_tokens - self.max_batch_size
            object.__setattr__(self, "max_prefill_tokens_per_step", room if room >= 64 else 2048)
        if self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, got {self.max_graph_tokens}")
        positive = ("adapter_page_rows", "max_rank", "max_batch_size", "max_input_tokens", "max_total_tokens",
                    "max_queue", "max_prefill_tokens_per_step", "max_inflight_loads", "disk_workers", "host_cache_bytes",
                    "adapter_cache_bytes", "adapter_fetch_workers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sample_stalls_ms < 0:
            raise ValueError(f"sample_stalls_ms must be >= 0, got {self.sample_stalls_ms}")
        for name in ("kv_cache_bytes", "num_slots", "adapter_memory_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_slots is not None and self.adapter_memory_bytes is not None:
            raise ValueError(f"set num_slots ({self.num_slots}) or adapter_memory_bytes ({self.adapter_memory_bytes}), "
                             "not both")
        for name in ("kv_cache_memory_fraction", "adapter_memory_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {tuple(DTYPES)}, got {self.dtype!r}")
        unknown = set(self.target_modules) - set(TARGET_NAMES)
        if unknown:
            raise ValueError(f"target_modules {sorted(unknown)} are not supported; choose from {TARGET_NAMES}")
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must exceed max_input_tokens ({self.max_input_tokens})"
            )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
