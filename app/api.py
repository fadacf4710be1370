"""OpenAI-compatible request and response bodies (pydantic, at the HTTP edge)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.errors import InvalidRequest
from app.sampling import MAX_STOP_STRINGS, SamplingParams

MAX_TOKENS_LIMIT = 1 << 20
MAX_PROMPT_CHARS = 1 << 20
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]  # the ingress checks the vocabulary's size


def _utf8(text: str, what: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text (a lone surrogate at character {e.start})") from None
    return text


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="An adapter name, or the base model's id.", max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1 disables top-k (vLLM extension).")
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = Field(default=None, description=f"Up to {MAX_STOP_STRINGS} stop strings.")
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1, le=1, description="Only n=1 is supported.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (vLLM extension).")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        return [_utf8(s, "a stop string") for s in stops]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: str | list[TokenId] = Field(description="One prompt: text, or token ids.")
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return _utf8(prompt, "prompt") if isinstance(prompt, str) else prompt

    def check_supported(self) -> None:
        if self.echo or self.logprobs or self.suffix:
            raise InvalidRequest("echo, logprobs and suffix are not supported")


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)

    @field_validator("content")
    @classmethod
    def _content(cls, content):
        return _utf8(content, "content")


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    logprobs: bool | None = Field(default=None, description="Not supported: true is a 400.")
    top_logprobs: int | None = Field(default=None, description="Not supported: a positive value is a 400.")

    def check_supported(self) -> None:
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs and top_logprobs are not supported")


class AdapterRegistration(BaseModel):
    name: str = Field(description="Adapter name used as `model`.", max_length=128)
    path: str = Field(description="Folder under one of the configured adapter roots.", max_length=4096)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id, model, text, finish_reason, prompt_tokens, completion_tokens) -> dict:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(request_id, model, text, finish_reason) -> dict:
    return {"id": request_id, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_body(request_id, model, text, finish_reason, prompt_tokens, completion_tokens) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(request_id, model, delta: dict, finish_reason) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
