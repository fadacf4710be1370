"""A request's life inside the engine, and what it streams out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.engine.detokenizer import IncrementalText
from app.errors import ServingError
from app.sampling.logprobs import TokenLogprob
from app.sampling.params import SamplingParams, StopChecker
from app.sampling.structured import Grammar


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str  # new text since the previous output
    token_ids: tuple[int, ...]  # new tokens since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: ServingError | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, where the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # every prompt token (the first's is None), once


@dataclass(eq=False)
class Request:
    request_id: str
    adapter_id: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0  # the row's random stream (app/sampling/sampler.py); drawn at random when the client gives none
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens (prompt, then output) whose K/V are in the cache
    slot: int | None = None  # pinned device slot while running
    adapter_waited: bool = False  # its wait from arrival to its adapter's slot is recorded (once, not on preemption)
    emitted: int = 0  # characters of decoded output already streamed
    detokenizer: IncrementalText | None = None  # the output's text, decoded a window at a time
    finish_reason: str | None = None
    first_token_at: float | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., as prefill computes them
    prompt_logprobs_sent: bool = False
    grammar: Grammar | None = None  # response_format's matcher (app/sampling/structured.py), advanced by each token
    # A live request with the same prompt and adapter whose first prefix_tokens prompt tokens (whole KV blocks)
    # this one starts from once they are cached (app/engine/scheduler.py), instead of prefilling them again.
    prefix_source: Request | None = None
    prefix_tokens: int = 0

    def __post_init__(self):
        self.stop_checker = StopChecker(self.params.stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the prompt followed by the output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]
