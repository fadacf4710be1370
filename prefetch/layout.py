"""The byte layout of one adapter in a slot, shared by the host cache and the device slot tensors.

An adapter is packed into one flat buffer: for each target module, A zero-padded to
[max_rank, in_features], then Bᵀ zero-padded to [max_rank, out_features]. A host->device load
is then a single contiguous copy, and padding rows contribute exact zeros to the LoRA product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class Segment:
    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    kind: str  # "A" or "BT"
    offset: int  # in elements
    rows: int  # max_rank
    cols: int  # in_features for A, out_features for BT

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class SlotLayout:
    """Segments of every supported module in a fixed order. Pure metadata; owns no tensors."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], max_rank: int):
        self.max_rank = max_rank
        self.modules = list(shapes)
        self.module_index = {module: i for i, module in enumerate(self.modules)}
        self.shapes = dict(shapes)
        segments, offset = [], 0
        for module, (in_features, out_features) in shapes.items():
            for kind, cols in (("A", in_features), ("BT", out_features)):
                segments.append(Segment(module, kind, offset, max_rank, cols))
                offset += max_rank * cols
        self.segments = segments
        self.numel = offset

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * torch.empty((), dtype=dtype).element_size()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-segment [rows, cols] views into a flat buffer of this layout."""
        return [flat[s.offset : s.offset + s.numel].view(s.rows, s.cols) for s in self.segments]

    def pack(self, weights: Mapping, dtype: torch.dtype, out: torch.Tensor | None = None):
        """Pack {module: LoRAWeights(A [r,in], B [out,r], scale)} into (flat [numel], scales [n_modules] fp32).

        Modules the adapter does not target stay zero with scale 0.
        """
        flat = out if out is not None else torch.empty(self.numel, dtype=dtype)
        flat.zero_()
        scales = torch.zeros(len(self.modules), dtype=torch.float32)
        views = self.views(flat)
        for segment, view in zip(self.segments, views):
            lora = weights.get(segment.module)
            if lora is None:
                continue
            if segment.kind == "A":
                view[: lora.A.shape[0]].copy_(lora.A)
                scales[self.module_index[segment.module]] = lora.scale
            else:
                view[: lora.B.shape[1]].copy_(lora.B.T)
        return flat, scales
