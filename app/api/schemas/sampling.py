"""The sampling fields that completions and chat share, and response_format (structured output)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from app.api.schemas.common import MAX_N, MAX_TOKENS_LIMIT, StrictBody, TokenId, utf8
from app.errors import UnsupportedField
from app.sampling.params import LOGIT_BIAS_LIMIT, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from app.sampling.structured import json_object_spec, json_schema_spec

MAX_SCHEMA_CHARS = 64 << 10  # a response_format schema, as compact JSON
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class JsonSchemaFormat(StrictBody):
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


class ResponseFormat(StrictBody):
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


class SamplingBody(StrictBody):
    """The fields of completions and chat bodies alike: model, length, sampling, penalties, stops, format."""

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
        return [utf8(s, "a stop string") for s in stops]

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
        """400 naming the first field that this server does not implement (app/api/schemas/__init__.py)."""
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

