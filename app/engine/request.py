"""A request's life inside the engine, and what it streams out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.engine.detokenizer import IncrementalText
from app.errors import ServingError
from app.sampling.logprobs import TokenLogprob
from app.sampling.params import SamplingParams, StopChecker
from app.sampling.structured import Grammar


PENDING_TOKEN = -1  # an input position whose token the previous step sampled and the device still holds


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
    # Tokens sampled on the device and not yet read back (EngineConfig.overlap_steps: a step launches before the
    # one before it is read back), and the newest one's row among its step's sampled rows.
    pending: int = 0
    pending_row: int = -1

    def __post_init__(self):
        self.stop_checker = StopChecker(self.params.stop)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + self.num_output_tokens

    @property
    def has_all_tokens(self) -> bool:
        """Its last token is sampled, not yet read back: no step has anything to feed it."""
        return self.pending > 0 and self.num_output_tokens >= self.params.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the prompt followed by the output; PENDING_TOKEN where one is not yet read back."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        known = self.prompt_ids[start:] + self.output_ids[max(0, start - n):end - n]
        return known + [PENDING_TOKEN] * (end - start - len(known))


class PromptIndex:
    """The latest live request for each (adapter, prompt), so that a new request with the same ones starts from
    its cached prompt blocks: the n choices of a prompt (and identical prompts) prefill it once."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._latest: dict[tuple, Request] = {}  # (adapter, prompt ids) -> the latest live request with them

    def link(self, request: Request) -> None:
        """Point `request` at the latest live request with its adapter and prompt (app/engine/scheduler.py waits
        for that one's whole prompt blocks). A request that wants its prompt's logprobs (echo) computes them
        itself."""
        key = (request.adapter_id, tuple(request.prompt_ids))
        source = self._latest.get(key)
        tokens = (len(request.prompt_ids) - 1) // self.block_size * self.block_size
        if source is not None and source.finish_reason is None and tokens and request.params.prompt_logprobs is None:
            request.prefix_source, request.prefix_tokens = source, tokens
        self._latest[key] = request

    def forget(self, request: Request) -> None:
        """`request` ended."""
        key = (request.adapter_id, tuple(request.prompt_ids))
        if self._latest.get(key) is request:
            del self._latest[key]
