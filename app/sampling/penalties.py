"""vLLM's logits processors for every row of a batch at once, on the device.

`apply_penalties` replaces this loop, in vLLM's order (its sampler applies min_tokens and logit_bias,
then the penalties, then temperature):

    for b in rows:
        if len(output[b]) < min_tokens[b]: logits[b, eos_ids | stop_token_ids[b]] = -inf
        logits[b, t] += bias[b][t]                            for t in logit_bias[b]
        for t in set(prompt[b]) | set(output[b]):             # transformers' RepetitionPenaltyLogitsProcessor
            logits[b, t] = logits[b, t] / rep[b] if logits[b, t] > 0 else logits[b, t] * rep[b]
        logits[b, t] -= freq[b] * count(output[b], t) + pres[b] * (count(output[b], t) > 0)   # OpenAI's formula

The state is rebuilt from each row's token history at every step (one padded id tensor, scattered on
the device), so it is right whichever rows join, leave or are preempted and recomputed. The host
builds that tensor only when some row of the step uses a penalty, so only those requests pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from app.sampling.params import SamplingParams


class History(Protocol):
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


def apply_penalties(logits: torch.Tensor, rows: Sequence[History], eos_ids: Sequence[int]) -> torch.Tensor:
    """logits [B, V] -> float32 with every row's processors applied (the input itself when no row has any)."""
    if not any(r.params.has_penalties for r in rows):
        return logits
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    scalars = torch.tensor([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                            for r in rows], dtype=torch.float32).to(device, non_blocking=True)  # [B, 3]
    below_min = [len(r.output_ids) < r.params.min_tokens for r in rows]
    if any(below_min):
        masked = [list(eos_ids) + list(r.params.stop_token_ids) if low else [] for r, low in zip(rows, below_min)]
        logits = logits.masked_fill(_scatter_mask(masked, batch, vocab, device), float("-inf"))
    if any(r.params.logit_bias for r in rows):
        ids = _padded([[t for t, _ in r.params.logit_bias] for r in rows], vocab, device)
        bias = _padded([[b for _, b in r.params.logit_bias] for r in rows], 0.0, device, torch.float32)
        logits = logits + torch.zeros(batch, vocab + 1, device=device).scatter_add_(1, ids, bias)[:, :vocab]
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = _scatter_mask([r.prompt_ids + r.output_ids if r.params.repetition_penalty != 1.0 else []
                              for r in rows], batch, vocab, device)
        rep = scalars[:, :1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in rows):
        ids = _padded([r.output_ids for r in rows], vocab, device)
        counts = torch.zeros(batch, vocab + 1, device=device).scatter_add_(
            1, ids, torch.ones(ids.shape, device=device))[:, :vocab]
        logits = logits - scalars[:, 1:2] * counts - scalars[:, 2:3] * (counts > 0).float()
    return logits


def _padded(lists: Sequence[Sequence], pad, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """[B, max(len)] from ragged rows; integer rows pad with an out-of-vocabulary column the callers drop."""
    width = max(1, max(len(x) for x in lists))
    host = torch.tensor([list(x) + [pad] * (width - len(x)) for x in lists], dtype=dtype)
    return host.to(device, non_blocking=True)


def _scatter_mask(ids: Sequence[Sequence[int]], batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool, True at each row's ids."""
    index = _padded(ids, vocab, device)
    return torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter_(1, index, True)[:, :vocab]
