"""`build_app` arguments: validated once by pydantic, documented field by field in docs/configuration.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.adapters.format import CONFIG_NAME
from app.adapters.remote import RemoteStore, is_remote
from app.engine.config import GiB, EngineConfig

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "demo" / "tiny"


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(default=str(DEMO_DIR / "base"), description="Path of the base model (transformers format).")
    model_id: str | None = Field(default=None, description="Name of the base model in the API; default: the folder name.")
    adapter_roots: list[str] = Field(default=[str(DEMO_DIR / "adapters")],
                                     description="Where adapters may be registered from: local folders (symlinks "
                                     "resolved) and URI prefixes: s3://bucket/prefix, gs://bucket/prefix, "
                                     "hf://org (or hf://org/repo), http(s)://host/path.")
    adapters: dict[str, str] | Literal["discover"] = Field(
        default="discover", description="Adapters registered at start: {name: path or URI}, or 'discover' (every "
                                        "sub-folder of every root that holds adapter_config.json).")
    adapter_cache_dir: str | None = Field(
        default=None, description="The node's disk cache of remote adapters, shared by the replicas on a node and "
        "kept across restarts. Default: $XDG_CACHE_HOME/lora-serve/adapters, else ~/.cache/lora-serve/adapters.")
    adapter_cache_bytes: int = Field(default=32 * GiB, ge=1, description="Byte budget of that disk cache; least "
                                     "recently used adapters not being read are evicted beyond it.")
    adapter_fetch_workers: int = Field(default=8, ge=1, description="Remote adapters fetched ahead at once per replica "
                                       "(and as many for requests already at it), and 16 MiB ranges fetched at once "
                                       "over all downloads.")
    adapter_fetch_timeout_s: float = Field(default=60.0, gt=0, description="Limit of one call to a store; a store "
                                           "that hangs fails the requests that need it with 503 and Retry-After.")
    build_demo: bool = Field(default=True, description="Generate the tiny demo if base_model is the demo's and missing.")
    num_slots: int | None = Field(default=None, ge=1, description="Override: exactly this many device adapter "
                                  "slots, each given the memory of a max_rank adapter. Default: size by bytes.")
    adapter_memory_bytes: int | None = Field(default=None, ge=1, description="Device memory for adapters per replica, "
                                             "in pages of rank rows; an adapter takes the pages its rank needs. "
                                             "Default: adapter_memory_fraction of the GPU memory left after the "
                                             "weights (CPU: 8 max_rank adapters).")
    adapter_memory_fraction: float = Field(default=0.2, gt=0, le=1, description="Share of the GPU memory free after "
                                           "the weights that adapters take when neither num_slots nor "
                                           "adapter_memory_bytes is set.")
    max_rank: int = Field(default=16, ge=1, description="Largest adapter rank accepted.")
    host_cache_bytes: int = Field(default=4 * GiB, ge=1, description="Host (pinned) adapter cache per replica.")
    max_adapter_bytes: int = Field(default=2 * GiB, ge=1, description="Largest adapter file accepted.")
    device: str = Field(default="auto", description="auto | cpu | cuda. auto uses a GPU per replica when the cluster has GPUs.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="auto: bfloat16 on CUDA, float32 on CPU.")
    max_batch_size: int = Field(default=32, ge=1, description="Rows in one decode batch.")
    max_input_tokens: int = Field(default=2048, ge=1, description="Longest prompt, in tokens.")
    max_total_tokens: int = Field(default=65536, ge=2, description="KV cache capacity in tokens on CPU (or where "
                                  "kv_cache_bytes is unset and there is no GPU).")
    kv_cache_bytes: int | None = Field(default=None, ge=1, description="KV cache size per replica. Default: "
                                       "kv_cache_memory_fraction of the GPU memory left after weights and slots.")
    kv_cache_memory_fraction: float = Field(default=0.85, gt=0, le=1, description="Share of the free GPU memory the "
                                            "KV cache takes when kv_cache_bytes is unset.")
    max_prefill_tokens_per_step: int | None = Field(
        default=None, ge=1, description="Prefill tokens in one engine step; longer prompts are prefilled in chunks "
        "between decode steps. Default: max_graph_tokens - max_batch_size (480), so that steps that prefill replay a "
        "CUDA graph; 2048 where that leaves under 64.")
    max_graph_tokens: int = Field(default=512, ge=0, description="Steps that prefill, of up to this many tokens "
                                  "(decode rows plus prompt tokens), replay CUDA graphs captured at start-up; larger "
                                  "ones run eagerly (CUDA only; 0: decode steps only).")
    cuda_graphs: bool = Field(default=True, description="Capture decode steps in CUDA graphs (CUDA only).")
    compile_decode: bool = Field(
        default=True, description="torch.compile the decoder before capturing the decode graphs (CUDA only): "
        "faster decode steps for about a minute more start-up.")
    engine_process: bool | None = Field(
        default=None, description="Run each replica's engine loop in its own process, so that it shares no GIL "
        "with the replica's event loop (which turns every step's outputs into stream chunks). Default (null): in "
        "its own process where the replica runs on CUDA (H100 under HTTP load: 18-23% more output tokens/s), on a "
        "thread on CPU (no gain measured there, and one process fewer per replica).")
    stream_interval_ms: float = Field(
        default=0, ge=0, le=1000, description="After a stream's first chunk, send its later tokens at most this "
        "often, merged into one chunk (0: every token as it comes). Each chunk crosses replica -> ingress -> "
        "client as a message; merging trades smoothness for throughput when many streams run (Ray Serve LLM "
        "merges every 50 ms by default).")
    max_queue: int = Field(default=256, ge=1, description="Requests waiting inside a replica before 429.")
    default_max_tokens: int = Field(default=16, ge=1, description="max_tokens when a request gives none (OpenAI: 16).")
    prefetch: bool = Field(default=True, description="Asynchronous prefetch (False: load on demand, synchronously).")
    max_ongoing_requests: int | None = Field(default=None, ge=1, description="Requests a replica accepts at once (a batch plus "
                                             "its engine queue); more wait in the router and trigger hints. "
                                             "Default: 2 x max_batch_size.")
    router: Literal["adapter_affinity", "serve_default"] = Field(
        default="adapter_affinity", description="adapter_affinity: our router with hints; serve_default: Serve's own.")
    replica_transport: Literal["grpc", "actor"] = Field(
        default="grpc", description="How the ingress calls replicas: grpc sends each call straight to the replica's "
        "gRPC server (Serve's by-value handles); actor goes through Ray actor calls and the object store "
        "(about 6-8 ms more per request on TTFT).")
    hints: bool = Field(default=True, description="The adapter_affinity router sends adapter hints to replicas; "
                        "False keeps its placement but sends none (the benchmark's A0 arm).")
    hint_depth: int = Field(default=48, ge=0, le=1000, description="With hints, how many pending requests behind "
                            "those Serve routes at a time (two per replica) the router places and hints too, so that "
                            "a remote adapter's fetch starts while its request still waits; they never take a replica "
                            "ahead of an older request.")
    spread_after_s: float = Field(default=0.2, ge=0, description="A request waiting this long for a saturated replica "
                                                                 "that holds its adapter may go to a free one instead.")
    api_key: str | None = Field(default=None, description="Bearer key required on every route but /health. "
                                                          "Default: the LORA_SERVE_API_KEY environment variable.")
    allow_adapter_registration: bool = Field(default=True, description="Enable POST/DELETE /v1/adapters.")
    max_pending_requests: int = Field(default=1024, ge=1, description="Requests in flight at one ingress replica "
                                      "before it answers 429 with Retry-After.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="Largest request body (413 beyond).")

    @model_validator(mode="after")
    def _check(self):
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must exceed "
                             f"max_input_tokens ({self.max_input_tokens})")
        if self.num_slots is not None and self.adapter_memory_bytes is not None:
            raise ValueError(f"set num_slots ({self.num_slots}) or adapter_memory_bytes "
                             f"({self.adapter_memory_bytes}), not both")
        if self.api_key is None:
            self.api_key = os.environ.get("LORA_SERVE_API_KEY") or None
        return self

    @property
    def served_model_id(self) -> str:
        return self.model_id or Path(self.base_model).name

    def engine_in_process(self) -> bool:
        """Whether a replica runs its engine loop in a child process: engine_process, or by default on CUDA."""
        if self.engine_process is not None:
            return self.engine_process
        return self.engine_config().torch_device().type == "cuda"

    sample_stalls_ms: float = Field(
        default=0.0, ge=0, description="Diagnostics: sample where each replica's engine thread is while a host part "
        "of its loop (a step's admission, launch or output, or the gap between steps) runs longer than this many "
        "ms; the counts are in the engine's step_timing metrics, under stalls. 0: off.")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            base_model=self.base_model, adapter_roots=tuple(self.adapter_roots), num_slots=self.num_slots,
            adapter_memory_bytes=self.adapter_memory_bytes, adapter_memory_fraction=self.adapter_memory_fraction,
            max_rank=self.max_rank, host_cache_bytes=self.host_cache_bytes, max_adapter_bytes=self.max_adapter_bytes,
            device=self.device, dtype=self.dtype, max_batch_size=self.max_batch_size,
            max_input_tokens=self.max_input_tokens, max_total_tokens=self.max_total_tokens, max_queue=self.max_queue,
            prefetch=self.prefetch, kv_cache_bytes=self.kv_cache_bytes,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            max_prefill_tokens_per_step=self.max_prefill_tokens_per_step, max_graph_tokens=self.max_graph_tokens,
            cuda_graphs=self.cuda_graphs,
            compile_decode=self.compile_decode,
            adapter_cache_dir=self.adapter_cache_dir, adapter_cache_bytes=self.adapter_cache_bytes,
            adapter_fetch_workers=self.adapter_fetch_workers, adapter_fetch_timeout_s=self.adapter_fetch_timeout_s,
            sample_stalls_ms=self.sample_stalls_ms,
        )

    def initial_adapters(self) -> dict[str, str]:
        if self.adapters != "discover":
            return dict(self.adapters)
        found = {}
        for root in self.adapter_roots:
            if is_remote(root):
                store = RemoteStore([root], self.adapter_fetch_timeout_s)
                try:
                    for name, uri in store.discover(store.roots[0], CONFIG_NAME).items():
                        found.setdefault(name, uri)
                finally:
                    store.shutdown()
                continue
            for folder in sorted(Path(root).glob(f"*/{CONFIG_NAME}")):
                found.setdefault(folder.parent.name, str(folder.parent))
        return found
