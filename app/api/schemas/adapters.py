"""The adapter routes: POST /v1/adapters, and vLLM's load and unload routes."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.api.schemas.common import StrictBody


class AdapterRegistration(BaseModel):
    name: str = Field(description="Adapter name used as `model`.", max_length=128)
    path: str = Field(description="Folder under one of the configured adapter roots.", max_length=4096)


class LoadLoRAAdapterRequest(StrictBody):
    """vLLM's POST /v1/load_lora_adapter: the same registration as POST /v1/adapters, under vLLM's names."""

    lora_name: str = Field(description="Adapter name used as `model`.", max_length=128)
    lora_path: str = Field(description="Folder under one of the configured adapter roots.", max_length=4096)


class UnloadLoRAAdapterRequest(StrictBody):
    """vLLM's POST /v1/unload_lora_adapter: DELETE /v1/adapters/{lora_name}."""

    lora_name: str = Field(description="The adapter to unregister.", max_length=128)

