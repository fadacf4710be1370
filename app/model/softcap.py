"""Final-logit soft-capping (Gemma 2): transformers applies it in the CausalLM's forward, which the engine never
calls (it runs the decoder and lm_head itself, eagerly and inside CUDA graphs), so the head is wrapped instead
and every caller of `model.lm_head` gets capped logits."""

from __future__ import annotations

import torch
from torch import nn


class SoftcappedHead(nn.Module):
    def __init__(self, head: nn.Module, cap: float):
        super().__init__()
        self.head = head
        self.cap = cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # transformers' order of operations, so float32 logits match its own bit for bit
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


def install_logit_softcap(model: nn.Module, cap: float | None) -> None:
    if cap is not None and not isinstance(model.lm_head, SoftcappedHead):
        model.lm_head = SoftcappedHead(model.lm_head, cap)
