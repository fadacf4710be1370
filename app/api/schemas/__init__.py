"""OpenAI-compatible request bodies (pydantic, at the HTTP edge); response bodies are app/api/responses.py.

The rule: every field a body accepts is declared here, and each one that changes what is generated is
either implemented or refused with a 400 naming it (`check_supported`). A field the schema does not
declare is refused too, with a 400 naming it, rather than dropped: a client must never get a decoding
other than the one it asked for without being told.

One module per concept: common (limits, strictness, the validated Generation), sampling (the fields that
completions and chat share), completions, chat, adapters (the registration routes), tokenize.
"""

from app.api.schemas.adapters import AdapterRegistration, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from app.api.schemas.chat import ChatCompletionRequest, ChatMessage, ContentPart, conversation
from app.api.schemas.common import MAX_N, MAX_PROMPT_CHARS, MAX_TOKENS_LIMIT, Generation, StrictBody, TokenId, new_id
from app.api.schemas.completions import MAX_CHOICES, MAX_PROMPTS, CompletionRequest
from app.api.schemas.sampling import MAX_SCHEMA_CHARS, JsonSchemaFormat, ResponseFormat, SamplingBody
from app.api.schemas.tokenize import DetokenizeRequest, TokenizeRequest

__all__ = [
    "MAX_CHOICES", "MAX_N", "MAX_PROMPTS", "MAX_PROMPT_CHARS", "MAX_SCHEMA_CHARS", "MAX_TOKENS_LIMIT",
    "AdapterRegistration", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart",
    "DetokenizeRequest", "Generation", "JsonSchemaFormat", "LoadLoRAAdapterRequest", "ResponseFormat",
    "SamplingBody", "StrictBody", "TokenId", "TokenizeRequest", "UnloadLoRAAdapterRequest", "conversation",
    "new_id",
]
