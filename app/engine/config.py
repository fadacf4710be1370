"""The engine's settings: each one's type, default, limits and description, defined here once.

A frozen pydantic dataclass: it validates itself when built (and again under `dataclasses.replace`), the engine
and the benchmarks build it directly, and the app's args (deploy/args.py) take their engine fields from it.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from app.adapters.targets import TARGET_NAMES

GiB = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Below this much room in max_graph_tokens, prefill runs EAGER_PREFILL_TOKENS a step eagerly: graph-sized steps fill
# a large batch too slowly (256 sequences on one H200: 2048-token steps gave 1.23x the output tokens/s of 256-token
# steps; 128: alike). 4096-token steps gave 1.10x 2048's; 8192 no more, in steps twice as long (docs/benchmarks.md).
MIN_GRAPH_PREFILL_TOKENS = 384
EAGER_PREFILL_TOKENS = 4096


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EngineConfig:
    base_model: str = Field(description="Path of the base model (transformers format).")
    adapter_roots: tuple[str, ...] = Field(
        default=(), description="Where adapters may be registered from: local folders (symlinks resolved) and URI "
        "prefixes: s3://bucket/prefix, gs://bucket/prefix, hf://org (or hf://org/repo), http(s)://host/path.")
    # Device adapter memory, in pages of `adapter_page_rows` rank rows: an adapter takes the pages its rank needs.
    num_slots: int | None = Field(
        default=None, ge=1, description="Override: exactly this many device adapter slots, each given the memory "
        "of a max_rank adapter. Default: size by bytes.")
    adapter_memory_bytes: int | None = Field(
        default=None, ge=1, description="Device memory for adapters per replica, in pages of rank rows; an adapter "
        "takes the pages its rank needs. Default: adapter_memory_fraction of the GPU memory left after the weights "
        "(CPU: 8 max_rank adapters).")
    adapter_memory_fraction: float = Field(
        default=0.2, gt=0, le=1, description="Share of the GPU memory free after the weights that adapters take "
        "when neither num_slots nor adapter_memory_bytes is set.")
    adapter_page_rows: int = Field(default=4, ge=1, description="Rank rows in one page of adapter memory.")
    max_rank: int = Field(default=16, ge=1, description="Largest adapter rank accepted.")
    target_modules: tuple[str, ...] = Field(
        default=TARGET_NAMES, description="The modules adapters may target, where the base model has them.")
    host_cache_bytes: int = Field(default=4 * GiB, ge=1, description="Host (pinned) adapter cache per replica.")
    max_adapter_bytes: int = Field(default=2 * GiB, ge=1, description="Largest adapter file accepted.")
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N. auto: a GPU where there is one.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 on CUDA, float32 on CPU.")
    quantization: Literal["fp8"] | None = Field(
        default=None, description="fp8: the base model's linear projections in float8_e4m3fn, one scale per output "
        "channel, activations quantized per token (CUDA GPUs with FP8 tensor cores: compute capability 8.9 or "
        "more). Adapters, embeddings, norms and lm_head stay in `dtype`.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=16, description="Devices one replica's model is sharded over (Megatron-style tensor "
        "parallelism: each holds its share of every layer's heads and MLP, and of every adapter). The size must "
        "divide the attention heads and the MLP width, and divide or be a multiple of the key/value heads.")
    max_batch_size: int = Field(default=32, ge=1, description="Rows in one decode batch.")
    max_input_tokens: int = Field(default=2048, ge=1, description="Longest prompt, in tokens.")
    max_total_tokens: int = Field(
        default=65536, ge=2, description="KV cache capacity in tokens on CPU (or where kv_cache_bytes is unset and "
        "there is no GPU).")
    kv_cache_bytes: int | None = Field(
        default=None, ge=1, description="KV cache size per replica. Default: kv_cache_memory_fraction of the GPU "
        "memory left after weights and adapters.")
    kv_cache_memory_fraction: float = Field(
        default=0.85, gt=0, le=1, description="Share of the free GPU memory the KV cache takes when kv_cache_bytes "
        "is unset.")
    block_size: Literal[16, 32, 64] = Field(default=16, description="Tokens per KV cache block.")
    cuda_graphs: bool = Field(default=True, description="Capture decode steps in CUDA graphs (CUDA only).")
    compile_decode: bool = Field(
        default=True, description="torch.compile the decoder before capturing the decode graphs, and run it for "
        "the steps too large for a graph (CUDA only): faster steps for a longer start-up.")
    max_graph_tokens: int = Field(
        default=512, ge=0, description="Steps that prefill, of up to this many tokens (decode rows plus prompt "
        "tokens), replay CUDA graphs captured at start-up; larger ones run eagerly (CUDA only; 0: decode steps "
        "only).")
    max_queue: int = Field(default=1024, ge=1, description="Requests waiting inside a replica's engine before 429.")
    max_prefill_tokens_per_step: int | None = Field(
        default=None, ge=1, description="Prefill tokens in one engine step; longer prompts are prefilled in chunks "
        "between decode steps. Default: max_graph_tokens - max_batch_size, so that steps that prefill replay a "
        "CUDA graph; 4096 where that leaves under 384.")
    overlap_steps: bool | None = Field(
        default=None, description="Launch each engine step before the previous one's tokens are read back, so the "
        "host plans and launches the next step while the GPU runs this one. Steps run one at a time while a running "
        "request uses penalties or a response_format (its sampling reads its own output). Default: on with one "
        "device; off with tensor_parallel_size > 1, whose GPU runs are tested with steps one at a time.")
    prefetch: bool = Field(default=True, description="Asynchronous prefetch (false: load on demand, synchronously).")
    max_inflight_loads: int = Field(default=2, ge=1, description="Adapter loads under way at once per replica.")
    hint_ttl_s: float = Field(default=30.0, gt=0, description="How long a replica keeps a hint whose request has "
                              "not come.")
    disk_workers: int = Field(default=2, ge=1, description="Threads reading adapters from disk into the host cache.")
    adapter_cache_dir: str | None = Field(
        default=None, description="The node's disk cache of remote adapters, shared by the replicas on a node and "
        "kept across restarts. Default: $XDG_CACHE_HOME/lora-serve/adapters, else ~/.cache/lora-serve/adapters.")
    adapter_cache_bytes: int = Field(
        default=32 * GiB, ge=1, description="Byte budget of that disk cache; least recently used adapters not being "
        "read are evicted beyond it.")
    adapter_fetch_workers: int = Field(
        default=8, ge=1, description="Remote adapters fetched ahead at once per replica (and as many for requests "
        "already at it), and 16 MiB ranges fetched at once over all downloads.")
    adapter_fetch_timeout_s: float = Field(
        default=60.0, gt=0, description="Limit of one call to a store; a store that hangs fails the requests that "
        "need it with 503 and Retry-After.")
    sample_stalls_ms: float = Field(
        default=0.0, ge=0, description="Diagnostics: sample where the engine thread is while a host part of its "
        "loop (a step's admission, launch or output, or the gap between steps) runs longer than this many ms; the "
        "counts are in the engine's step_timing metrics, under stalls. 0: off.")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.overlap_steps is None:
            object.__setattr__(self, "overlap_steps", self.tensor_parallel_size == 1)
        if self.max_prefill_tokens_per_step is None:
            room = self.max_graph_tokens - self.max_batch_size
            object.__setattr__(self, "max_prefill_tokens_per_step", room if room >= MIN_GRAPH_PREFILL_TOKENS
                               else EAGER_PREFILL_TOKENS)
        if self.num_slots is not None and self.adapter_memory_bytes is not None:
            raise ValueError(f"set num_slots ({self.num_slots}) or adapter_memory_bytes ({self.adapter_memory_bytes}), "
                             "not both")
        unknown = set(self.target_modules) - set(TARGET_NAMES)
        if unknown:
            raise ValueError(f"target_modules {sorted(unknown)} are not supported; choose from {TARGET_NAMES}")
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must exceed max_input_tokens ({self.max_input_tokens})")
        return self

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
