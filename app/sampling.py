"""Sampling parameters and stop-string handling for one request (the token choice is app/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import InvalidRequest

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
# Below this, logits / temperature overflows float32 (inf - inf = NaN in softmax); it means greedy anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class StopChecker:
    """Finds stop strings in the decoded text and holds back text that may be the start of one."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str, start: int) -> int | None:
        """Index of the earliest stop string in text that ends after `start`, or None."""
        best = None
        for s in self.stop:
            i = text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best):
                best = i
        return best

    def safe_end(self, text: str) -> int:
        """How much of text can be streamed without risking part of a stop string."""
        end = len(text) - self.holdback if self.stop else len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an unfinished multi-byte character
            end -= 1
        return max(end, 0)
