"""OpenAI-compatible request bodies (pydantic, at the HTTP edge); response bodies are app/api/responses.py.

The rule: every field a body accepts is declared here, and each one that changes what is generated is
either implemented or refused with a 400 naming it (`check_supported`). A field the schema does not
declare is refused too, with a 400 naming it, rather than dropped: a client must never get a decoding
other than the one it asked for without being told.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from app.errors import UnsupportedField
from app.sampling.params import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from app.sampling.structured import json_object_spec, json_schema_spec

MAX_TOKENS_LIMIT = 1 << 20
MAX_PROMPT_CHARS = 1 << 20
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request
MAX_CHOICES = 64  # prompts x n
MAX_SCHEMA_CHARS = 64 << 10  # a response_format schema, as compact JSON
# Strict: JSON true and 1.0 are not token ids. The ingress checks the vocabulary's size.
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 31)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _utf8(text: str, what: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text (a lone surrogate at character {e.start})") from None
    return text


@dataclass(frozen=True)
class Generation:
    """What a body asks for, once validated: the engine's parameters and the response's shape."""

    params: SamplingParams
    n: int
    echo: bool
    logprobs: int | None  # top alternatives to show per token; None shows no logprobs
    stream: bool
    include_usage: bool


class _Strict(BaseModel):
    # Undeclared fields are kept so that check_supported can name them in its 400.
    model_config = ConfigDict(extra="allow")

    def check_supported(self) -> None:
        if self.model_extra:
            name = sorted(self.model_extra)[0]
            raise UnsupportedField(name, f"unknown field {name!r}: this server refuses fields it does not "
                                         "implement rather than ignoring them")


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The schema's name (OpenAI's rule).")
    description: str | None = Field(default=None, description="Accepted, unused: it does not reach the model.")
    schema_: dict | bool = Field(alias="schema", description="A JSON Schema the output must validate against.")
    strict: bool | None = Field(default=None, description="Accepted: the output always follows the schema.")

    @field_validator("schema_")
    @classmethod
    def _size(cls, schema):
        if len(json_schema_spec(schema)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the schema has more than {MAX_SCHEMA_CHARS} characters as compact JSON")
        return schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="json_object: any JSON object; json_schema: JSON valid under json_schema.schema.")
    json_schema: JsonSchemaFormat | None = Field(default=None, description="Needed with type json_schema only.")

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only then")
        return self

    def check_supported(self) -> None:
        for part in (self, self.json_schema):
            if part is not None and part.model_extra:
                name = sorted(part.model_extra)[0]
                raise UnsupportedField(f"response_format.{name}", f"unknown field 'response_format.{name}' is "
                                                                  "not supported")

    def spec(self) -> str | None:
        """What SamplingParams.response_format carries (app/sampling/structured.py); None for plain text."""
        if self.type == "json_object":
            return json_object_spec()
        return json_schema_spec(self.json_schema.schema_) if self.json_schema else None


class _Body(_Strict):
    model: str = Field(description="An adapter name, or the base model's id.", max_length=256)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT,
                                   description="Tokens to generate (0 only with echo).")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1 disables top-k (vLLM extension).")
    seed: int | None = Field(default=None, ge=0, lt=1 << 63, description="Choice j of n uses seed + j.")
    stop: str | list[str] | None = Field(default=None, description=f"Up to {MAX_STOP_STRINGS} stop strings.")
    stream: bool = False
    stream_options: dict | None = Field(default=None, description="{'include_usage': true} adds a usage chunk.")
    n: int = Field(default=1, ge=1, le=MAX_N, description=f"Choices per prompt, up to {MAX_N}.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (vLLM extension).")
    user: str | None = Field(default=None, description="Recorded nowhere; it changes nothing.")
    presence_penalty: Penalty = Field(default=0.0, description="Subtracted once from every generated token's logit.")
    frequency_penalty: Penalty = Field(default=0.0, description="Subtracted per occurrence in the generated tokens.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False,
                                      description="Over prompt and generated tokens, transformers' formula (vLLM).")
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        default=None, description=f"Token id -> bias added to its logit, clamped to +-{LOGIT_BIAS_LIMIT:g}.")
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT, description="EOS and stop_token_ids are masked "
                                                                           "until this many tokens (vLLM).")
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="Token ids that end the output (vLLM).")
    include_stop_str_in_output: bool = Field(default=False, description="Keep the stop string or token (vLLM).")
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text (vLLM).")
    response_format: ResponseFormat | None = Field(default=None, description="text, json_object or json_schema: "
                                                   "the output follows a JSON grammar (app/sampling/structured.py).")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        return [_utf8(s, "a stop string") for s in stops]

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) >= 1 << 31:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            out[str(int(key))] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
        return out

    def check_supported(self) -> None:
        """400 naming the first field that this server does not implement (see the module docstring)."""
        super().check_supported()
        if self.response_format is not None:
            self.response_format.check_supported()
        for name, value in self.__dict__.items():
            reason = self._refused(name, value)
            if reason:
                raise UnsupportedField(name, f"{name} is not supported: {reason}")

    def _refused(self, name: str, value) -> str | None:
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
            logit_bias=tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items())),
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            response_format=self.response_format.spec() if self.response_format else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description=f"A prompt (text or token ids) or up to {MAX_PROMPTS} of them; choice index = prompt * n + j.")
    echo: bool = Field(default=False, description="Return the prompt before the completion (and its logprobs).")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                 description="The sampled token's logprob and the k likeliest (raw logits).")
    suffix: str | None = Field(default=None, description="Refused: insertion is not implemented.")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="Refused unless equal to n.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed, got {len(prompts)}")
        for p in prompts:
            if isinstance(p, str) and len(p) > MAX_PROMPT_CHARS:
                raise ValueError(f"a prompt has {len(p)} characters; the limit is {MAX_PROMPT_CHARS}")
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p, str):
                _utf8(p, "prompt")
        return prompt

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo)")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} is more than {MAX_CHOICES} choices")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def _refused(self, name, value):
        if name == "suffix" and value:
            return "insertion (fill-in-the-middle) is not implemented"
        if name == "best_of" and value not in (None, self.n):
            return f"best_of ({value}) must equal n ({self.n}); ranking extra samples is not implemented"
        return None

    def generation(self, default_max_tokens: int) -> Generation:
        params = self.sampling_params(default_max_tokens)
        params = replace(params, logprobs=self.logprobs,
                         prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None)
        return Generation(params, self.n, self.echo, self.logprobs, self.stream, self.include_usage)


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
            return _utf8(content, "content")
        for part in content:
            if part.text is not None:
                _utf8(part.text, "content")
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


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (content parts joined)."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
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
        params = replace(_Body.sampling_params(body, default_max_tokens), logprobs=k)
        return Generation(params, self.n, False, k, self.stream, self.include_usage)


class AdapterRegistration(BaseModel):
    name: str = Field(description="Adapter name used as `model`.", max_length=128)
    path: str = Field(description="Folder under one of the configured adapter roots.", max_length=4096)


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter: the same registration as POST /v1/adapters, under vLLM's names."""

    lora_name: str = Field(description="Adapter name used as `model`.", max_length=128)
    lora_path: str = Field(description="Folder under one of the configured adapter roots.", max_length=4096)


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter: DELETE /v1/adapters/{lora_name}."""

    lora_name: str = Field(description="The adapter to unregister.", max_length=128)


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a prompt, or messages through the chat template, as the generation routes do."""

    model: str = Field(description="An adapter name, or the base model's id (they share the tokenizer).",
                       max_length=256)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS, description="Text, as on completions.")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=256,
                                               description="Messages, as on chat completions.")
    add_special_tokens: bool | None = Field(default=None, description="Default: true for prompt, false for "
                                            "messages (the chat template holds BOS), as in vLLM.")
    add_generation_prompt: bool = Field(default=True, description="messages only: end with the assistant's turn.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        return prompt if prompt is None else _utf8(prompt, "prompt")

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


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize."""

    model: str = Field(description="An adapter name, or the base model's id.", max_length=256)
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_CHARS, description="Token ids: JSON integers (422 "
                                  "otherwise) below the vocabulary size (400 otherwise).")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
