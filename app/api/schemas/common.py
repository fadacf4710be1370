"""What every request body shares: the limits, the refusal of undeclared fields, and the validated result."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from app.errors import UnsupportedField
from app.sampling.params import SamplingParams

MAX_TOKENS_LIMIT = 1 << 20
MAX_PROMPT_CHARS = 1 << 20
MAX_N = 16  # choices per prompt
# Strict: JSON true and 1.0 are not token ids. The ingress checks the vocabulary's size.
TokenId = Annotated[StrictInt, Field(ge=0, lt=1 << 31)]


def utf8(text: str, what: str) -> str:
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


class StrictBody(BaseModel):
    """A body that refuses fields it does not declare."""

    # Undeclared fields are kept so that check_supported can name them in its 400.
    model_config = ConfigDict(extra="allow")

    def check_supported(self) -> None:
        if self.model_extra:
            name = sorted(self.model_extra)[0]
            raise UnsupportedField(name, f"unknown field {name!r}: this server refuses fields it does not "
                                         "implement rather than ignoring them")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
