"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from app.api.schemas.chat import ChatMessage, within_prompt_chars
from app.api.schemas.common import MAX_PROMPT_CHARS, StrictBody, TokenId, utf8


class TokenizeRequest(StrictBody):
    """vLLM's POST /tokenize: a prompt, or messages through the chat template, as the generation routes do."""

    model: str = Field(description="An adapter name, or the base model's id (they share the tokenizer).",
                       max_length=256)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS, description="Text, as on completions.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=256,
                                               description="Messages, as on chat completions.")
    add_special_tokens: bool | None = Field(default=None, description="Default: true for prompt, false for "
                                            "messages (the chat template holds BOS), as in vLLM.")
    add_generation_prompt: bool = Field(default=True, description="messages only: end with the assistant's turn.")

    _messages = field_validator("messages")(within_prompt_chars)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        return prompt if prompt is None else utf8(prompt, "prompt")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("add_generation_prompt applies to messages only")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        for message in self.messages or []:
            message.check_supported()


class DetokenizeRequest(StrictBody):
    """vLLM's POST /detokenize."""

    model: str = Field(description="An adapter name, or the base model's id.", max_length=256)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_CHARS, description="Token ids: JSON integers (422 "
                                  "otherwise) below the vocabulary size (400 otherwise).")

