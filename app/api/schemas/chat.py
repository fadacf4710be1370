"""POST /v1/chat/completions, and the messages that /tokenize takes too."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.api.schemas.common import MAX_PROMPT_CHARS, MAX_TOKENS_LIMIT, Generation, utf8
from app.api.schemas.sampling import SamplingBody
from app.errors import UnsupportedField
from app.sampling.params import MAX_LOGPROBS


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(description="Only 'text' is supported; any other type is a 400 naming it.")
    text: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[ContentPart] = Field(
        description="Text, or an array of {'type': 'text', 'text': ...} parts (joined with newlines).")

    @field_validator("content")
    @classmethod
    def _content(cls, content):
        if isinstance(content, str):
            return utf8(content, "content")
        for part in content:
            if part.text is not None:
                utf8(part.text, "content")
        return content

    def check_supported(self) -> None:
        if self.model_extra:
            name = sorted(self.model_extra)[0]
            raise UnsupportedField(f"messages.{name}", f"unknown message field {name!r} is not supported")
        for part in [] if isinstance(self.content, str) else self.content:
            if part.type != "text":
                raise UnsupportedField("messages.content", f"content parts of type {part.type!r} are not "
                                                           "supported; only {'type': 'text', 'text': ...}")
            if part.text is None or part.model_extra:
                raise UnsupportedField("messages.content", "a text content part has exactly the keys 'type' and "
                                                           f"'text', got {sorted(part.model_dump(exclude_none=True))}")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def within_prompt_chars(messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
    """The messages' texts together within the prompt's limit: the chat template's time grows with them."""
    total = sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content)
                for m in messages or ())  # parts are checked later: one may lack its text here
    if total > MAX_PROMPT_CHARS:
        raise ValueError(f"the messages hold {total} characters together; the limit is {MAX_PROMPT_CHARS}")
    return messages


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (content parts joined)."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    _messages = field_validator("messages")(within_prompt_chars)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT,
                                              description="OpenAI's newer name for max_tokens; it wins if both.")
    logprobs: bool = Field(default=False, description="Logprobs of each generated token (raw logits).")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                     description="The k likeliest tokens at each position; needs logprobs.")
    tools: list | None = Field(default=None, description="Refused unless empty: tool calling is not implemented.")
    tool_choice: str | dict | None = Field(default=None, description="Refused unless 'none'.")

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be >= 1")
        return self

    def check_supported(self) -> None:
        super().check_supported()
        for message in self.messages:
            message.check_supported()

    def _refused(self, name, value):
        if name == "top_logprobs" and value and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        if name == "tools" and value:
            return "tool calling is not implemented"
        if name == "tool_choice" and value not in (None, "none"):
            return "tool calling is not implemented"
        return None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def generation(self, default_max_tokens: int) -> Generation:
        body = self.model_copy(update={"max_tokens": self.max_completion_tokens or self.max_tokens})
        k = (self.top_logprobs or 0) if self.logprobs else None
        params = replace(SamplingBody.sampling_params(body, default_max_tokens), logprobs=k)
        return Generation(params, self.n, False, k, self.stream, self.include_usage)

