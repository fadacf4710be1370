"""`build_app` arguments: validated once by pydantic, documented field by field in docs/configuration.md."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from app.adapters.format import CONFIG_NAME
from app.adapters.remote import RemoteStore
from app.adapters.uris import is_remote
from app.engine.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "demo" / "tiny"
GRACE_S = 30  # how long a stopping replica lets its requests in flight finish (and `make serve`'s Ctrl-C waits)


class AppSettings(BaseModel):
    """The app's own args; AppArgs adds every engine setting to them, taken from EngineConfig."""

    model_config = ConfigDict(extra="forbid")

    model_id: str | None = Field(default=None, description="Name of the base model in the API; default: the folder name.")
    adapters: dict[str, str] | Literal["discover"] = Field(
        default="discover", description="Adapters registered at start: {name: path or URI}, or 'discover' (every "
                                        "sub-folder of every root that holds adapter_config.json).")
    build_demo: bool = Field(default=True, description="Generate the tiny demo if base_model is the demo's and missing.")
    engine_process: bool | None = Field(
        default=None, description="Run each replica's engine loop in its own process, so that it shares no GIL "
        "with the replica's event loop (which turns every step's outputs into stream chunks). Default (null): in "
        "its own process where the replica runs on CUDA, on a thread on CPU (one process fewer per replica).")
    stream_interval_ms: float = Field(
        default=0, ge=0, le=1000, description="After a stream's first chunk, send its later tokens at most this "
        "often, merged into one chunk (0: every token as it comes). Each chunk crosses replica -> ingress -> "
        "client as a message; merging trades smoothness for throughput when many streams run (Ray Serve LLM "
        "merges every 50 ms by default).")
    default_max_tokens: int = Field(default=16, ge=1, description="max_tokens when a request gives none (OpenAI: 16).")
    max_ongoing_requests: int | None = Field(default=None, ge=1, description="Requests a replica accepts at once (a batch plus "
                                             "its engine queue); more wait in the router and trigger hints. "
                                             "Default: 2 x max_batch_size.")
    router: Literal["adapter_affinity", "serve_default"] = Field(
        default="adapter_affinity", description="adapter_affinity: our router with hints; serve_default: Serve's own.")
    replica_transport: Literal["grpc", "actor"] = Field(
        default="grpc", description="How the ingress calls replicas: grpc sends each call straight to the replica's "
        "gRPC server (Serve's by-value handles); actor goes through Ray actor calls and the object store.")
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

    @model_validator(mode="before")
    @classmethod
    def _demo_by_default(cls, values):
        """The built-in demo's base model and adapter root where the args name none."""
        if isinstance(values, dict):
            values = {"base_model": str(DEMO_DIR / "base"), "adapter_roots": [str(DEMO_DIR / "adapters")], **values}
        return values

    @model_validator(mode="after")
    def _check(self):
        try:
            self.engine_config()  # the engine's own cross-field rules
        except ValidationError as e:
            raise ValueError("; ".join(error["msg"].removeprefix("Value error, ") for error in e.errors())) from None
        if self.api_key is None:
            self.api_key = os.environ.get("LORA_SERVE_API_KEY") or None
        return self

    @property
    def uses_demo(self) -> bool:
        """The built-in demo's base, generated on first use."""
        return self.build_demo and self.base_model == str(DEMO_DIR / "base")

    @property
    def served_model_id(self) -> str:
        return self.model_id or Path(self.base_model).name

    def engine_in_process(self) -> bool:
        """Whether a replica runs its engine loop in a child process: engine_process, or by default on CUDA."""
        if self.engine_process is not None:
            return self.engine_process
        return self.engine_config().torch_device().type == "cuda"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS})

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
            for name, folder in discover_local(root).items():
                found.setdefault(name, folder)
        return found


def discover_local(root: str) -> dict[str, str]:
    """name -> folder of each sub-folder of `root` that holds an adapter config."""
    configs = sorted(Path(root).expanduser().glob(f"*/{CONFIG_NAME}"))
    return {config.parent.name: str(config.parent) for config in configs}


# Every engine setting is an arg too, with EngineConfig's own type, default, limits and description.
ENGINE_FIELDS = tuple(field.name for field in dataclasses.fields(EngineConfig))
AppArgs = create_model("AppArgs", __base__=AppSettings, __doc__="`build_app`'s args: the app's own and the engine's.",
                       **{name: (info.annotation, info) for name, info in EngineConfig.__pydantic_fields__.items()})
