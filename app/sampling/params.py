"""Sampling parameters and stop-string handling for one request (the token choice is app/sampling/sampler.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.errors import InvalidRequest

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries; each bias is clamped to +-LOGIT_BIAS_LIMIT as vLLM does
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's limit
# Below this, logits / temperature overflows float32 (inf - inf = NaN in softmax); it means greedy anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only generates nothing (echo with prompt logprobs)
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # vLLM's logits processors (app/sampling/penalties.py), in the order they apply:
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    repetition_penalty: float = 1.0  # over prompt and output tokens (transformers' formula)
    frequency_penalty: float = 0.0  # over output tokens (OpenAI's formula)
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k likeliest
    prompt_logprobs: int | None = None  # the same for every prompt token (echo)
    # JSON text of a grammar spec (app/sampling/structured.py: json_object_spec, json_schema_spec), compiled in the
    # engine: a string, so the params pickle across the engine process's pipe and key the grammar cache.
    response_format: str | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidRequest(f"stop strings must be 1..{MAX_STOP_LENGTH} characters, got {len(s)}")
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise InvalidRequest(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_LIMIT):
                raise InvalidRequest(f"logit_bias entries must map token ids >= 0 to biases in "
                                     f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {token!r}: {bias!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; "
                                 f"the limit is {MAX_STOP_TOKEN_IDS}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.response_format is not None and not isinstance(self.response_format, str):
            raise InvalidRequest(f"response_format must be a grammar spec string, got {type(self.response_format)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Does any processor of app/sampling/penalties.py change this request's logits?"""
        return bool(self.min_tokens or self.logit_bias or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)

    def token_ids_in(self, vocab_size: int) -> None:
        """Refuse token ids that the model's vocabulary does not have."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequest(f"{name} has token id {bad[0]}, outside the vocabulary ({vocab_size} tokens)")


class StopChecker:
    """Finds stop strings in the decoded text and holds back text that may be the start of one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def match(self, text: str, start: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in text that ends after `start`, or None."""
        best = None
        for s in self.stop:
            i = text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def find(self, text: str, start: int) -> int | None:
        """Index of the earliest stop string in text that ends after `start`, or None."""
        found = self.match(text, start)
        return None if found is None else found[0]

    def safe_end(self, text: str) -> int:
        """How much of text can be streamed without risking part of a stop string."""
        end = len(text) - self.holdback if self.stop else len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an unfinished multi-byte character
            end -= 1
        return max(end, 0)
