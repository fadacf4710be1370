"""Log-probabilities of sampled and prompt tokens, on the device, packed for one host copy per step.

Values are log-softmax of the model's raw logits, before temperature, penalties and top-k/top-p (vLLM's
default, `logprobs_mode="raw_logprobs"`): they describe the model, not the request's sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None only for a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


def pack(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[N, 1 + 2k] float64: each row's chosen-token logprob, then its k likeliest ids and their logprobs.

    float64 holds both the ids (< 2**53) and the float32 logprobs exactly, so one copy carries all."""
    logprobs = logits.float().log_softmax(-1)  # [N, V]
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [N, 1]
    top = logprobs.topk(k, dim=-1)  # [N, k] each
    return torch.cat([chosen_lp.double(), top.indices.double(), top.values.double()], dim=1)


def unpack(values: Sequence[float], chosen: Sequence[int], width: int, ks: Sequence[int | None]) -> list:
    """Rows of `pack` (flattened, `width` = 1 + 2k each) -> a TokenLogprob per row, or None where k is None."""
    k_all = (width - 1) // 2
    out = []
    for i, (token, k) in enumerate(zip(chosen, ks)):
        if k is None:
            out.append(None)
            continue
        row = values[i * width:(i + 1) * width]
        ids, lps = row[1:1 + k_all], row[1 + k_all:]
        out.append(TokenLogprob(int(token), row[0], tuple((int(ids[j]), lps[j]) for j in range(k))))
    return out


@dataclass
class EchoRows:
    """The prompt positions of this step whose logits give prompt logprobs (echo with logprobs).

    Logits at position p predict prompt token p + 1; a request's positions are recorded once, in order,
    even when a preempted request prefills its prompt again."""

    rows: list[int] = field(default_factory=list)  # flat token index in the step (plan.chunks order)
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    owners: list = field(default_factory=list)  # the request each row belongs to

    @classmethod
    def of(cls, chunks) -> EchoRows:
        echo, offset = cls(), 0
        for chunk in chunks:
            request = chunk.request
            if request.params.prompt_logprobs is not None:
                last = len(request.prompt_ids) - 1
                for p in range(max(chunk.start, len(request.prompt_logprobs)), min(chunk.end, last)):
                    echo.rows.append(offset + p - chunk.start)
                    echo.targets.append(request.prompt_ids[p + 1])
                    echo.owners.append(request)
            offset += chunk.length
        return echo

    @property
    def k(self) -> int:
        return max((r.params.prompt_logprobs for r in self.owners), default=0)
