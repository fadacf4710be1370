"""The running decode batch: left-padded KV cache rows that requests join and leave between steps.

The pattern is TGI's non-flash CausalLMBatch: concatenate on join, filter on leave. Padding
columns hold zeros and are masked out, so they add exact zeros to attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig


class DecodeBatch:
    def __init__(self, config: PretrainedConfig, device: torch.device):
        self.config = config
        self.device = device
        self.rows: list = []  # the requests, one per row; each has .cache_length (real tokens cached)
        self.cache = DynamicCache(config=config)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [rows, cols], 1 = real token

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cols(self) -> int:
        return self.mask.shape[1]

    def join(self, request, cache: DynamicCache) -> None:
        """Append one prefilled request (batch of 1, no padding) to the batch."""
        length = request.cache_length
        new_mask = torch.ones(1, length, dtype=torch.long, device=self.device)
        if not self.rows:
            self.cache, self.mask = cache, new_mask
        else:
            cols = max(self.cols, length)
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([_left_pad(mine.keys, cols), _left_pad(theirs.keys, cols)])
                mine.values = torch.cat([_left_pad(mine.values, cols), _left_pad(theirs.values, cols)])
            self.mask = torch.cat([_left_pad_mask(self.mask, cols), _left_pad_mask(new_mask, cols)])
        self.rows.append(request)

    def keep(self, keep_rows: list[int]) -> None:
        """Keep only these rows, then drop leading columns that are padding in every row."""
        if len(keep_rows) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep_rows]
        if not self.rows:
            self.cache = DynamicCache(config=self.config)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        index = torch.tensor(keep_rows, device=self.device)
        start = self.cols - max(r.cache_length for r in self.rows)
        self.mask = self.mask.index_select(0, index)[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def grow(self) -> None:
        """Account for the column a decode step appended to every row."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        for request in self.rows:
            request.cache_length += 1


def _left_pad(t: torch.Tensor, cols: int) -> torch.Tensor:
    return F.pad(t, (0, 0, cols - t.shape[2], 0))


def _left_pad_mask(mask: torch.Tensor, cols: int) -> torch.Tensor:
    return F.pad(mask, (cols - mask.shape[1], 0))
