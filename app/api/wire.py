"""What the ingress and a LoRA replica exchange: the call, each choice's chunks, or an error.

Plain dataclasses: they cross Ray's pickling between the two processes, and both sides import them without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import ServingError
from app.sampling.logprobs import TokenLogprob
from app.sampling.params import SamplingParams


@dataclass(frozen=True)
class GenerateCall:
    """One API request's generation: len(prompts) * n choices, choice `index = prompt * n + j`."""

    prompts: list[str | list[int]]  # text, or token ids
    params: SamplingParams
    n: int = 1
    adapter_id: str | None = None  # None: the base model
    request_id: str | None = None

    def __post_init__(self):
        if not self.prompts or self.n < 1:
            raise ValueError(f"a call needs prompts and n >= 1, got {len(self.prompts)} prompts and n={self.n}")


@dataclass(frozen=True)  # no slots: pickling a frozen slotted dataclass costs more per chunk
class ChoiceChunk:
    """A choice's output since its previous chunk; a whole response holds one merged chunk per choice."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, where the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with echo and logprobs: the prompt's, once
    replica: str = ""  # the unique id of the replica that generated it


@dataclass(frozen=True)
class ErrorReply:
    """A ServingError as data. The exception itself does not cross pickling reliably: subclasses take
    arguments of their own."""

    status: int  # HTTP status
    body: dict  # OpenAI's {"error": {"message", "type", "code", ...}}
    retry_after_s: float | None = None

    @classmethod
    def of(cls, error: ServingError) -> ErrorReply:
        """The one place a ServingError becomes an HTTP status and body."""
        return cls(error.status_code, error.to_openai(), error.retry_after_s)
