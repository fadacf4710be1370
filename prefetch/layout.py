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

    def pack(self, parts: Mapping[str, tuple[torch.Tensor, torch.Tensor, int, float]], out: torch.Tensor
             ) -> torch.Tensor:
        """Pack {module: (A 1-D [r * in], B 1-D row-major [out * r], r, scale)} into `out` [numel]; return
        the scales [n_modules] float32. Modules the adapter does not target stay zero with scale 0.

        Every source and destination is a 1-D slice (row k of Bᵀ is B[k::r]), so the whole pack is one
        zero_ and one multi-tensor copy: two GIL handoffs however many modules (see AdapterFile).
        """
        dst, src = [], []
        scales = [0.0] * len(self.modules)
        for module, (a, b, rank, scale) in parts.items():
            index = self.module_index[module]
            in_features, out_features = self.shapes[module]
            a_seg, bt_seg = self.segments[2 * index], self.segments[2 * index + 1]
            dst.append(out[a_seg.offset : a_seg.offset + rank * in_features])
            src.append(a)
            for k in range(rank):
                row = bt_seg.offset + k * out_features
                dst.append(out[row : row + out_features])
                src.append(b[k::rank])
            scales[index] = scale
        out.zero_()
        if dst:
            torch._foreach_copy_(dst, src)
        return torch.tensor(scales, dtype=torch.float32)
