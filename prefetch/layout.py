"""The byte layout of adapter pages, shared by the host arena and the device page pool.

Adapter memory is one pool of *pages* (S-LoRA's unified paging, at a coarser grain): a page holds
`page_rows` rank rows of every target module, for each module A's rows [page_rows, in_features] then
Bᵀ's rows [page_rows, out_features]. An adapter of rank r takes ceil(r / page_rows) pages, anywhere in
the pool, so a rank-8 adapter takes a quarter of a rank-32 one's memory. Rank row k of an adapter lives
in its page k // page_rows at row k % page_rows; rows past a module's rank are zero (they add exact zeros).
A host->device load is one copy per page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class Segment:
    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    kind: str  # "A" or "BT"
    offset: int  # in elements, within a page
    rows: int  # page_rows
    cols: int  # in_features for A, out_features for BT

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class PageLayout:
    """Segments of every supported module within one page, in a fixed order. Pure metadata; owns no tensors."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], max_rank: int, page_rows: int = 4):
        if page_rows < 1 or max_rank < 1:
            raise ValueError(f"page_rows ({page_rows}) and max_rank ({max_rank}) must be >= 1")
        self.max_rank, self.page_rows = max_rank, page_rows
        self.modules = list(shapes)
        self.module_index = {module: i for i, module in enumerate(self.modules)}
        self.shapes = dict(shapes)
        segments, offset = [], 0
        for module, (in_features, out_features) in shapes.items():
            for kind, cols in (("A", in_features), ("BT", out_features)):
                segments.append(Segment(module, kind, offset, page_rows, cols))
                offset += page_rows * cols
        self.segments = segments
        self.page_numel = offset
        self.max_pages = self.pages_for(max_rank)  # pages of one adapter at max_rank

    def pages_for(self, rank: int) -> int:
        return max(1, -(-rank // self.page_rows))

    def page_nbytes(self, dtype: torch.dtype) -> int:
        return self.page_numel * torch.empty((), dtype=dtype).element_size()

    def adapter_nbytes(self, rank: int, dtype: torch.dtype) -> int:
        """Bytes an adapter of this rank occupies (a whole number of pages)."""
        return self.pages_for(rank) * self.page_nbytes(dtype)

    def module_views(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per module, (A [num_pages, page_rows, in], BT [num_pages, page_rows, out]) strided views of a
        pool [num_pages, page_numel]; a page's stride is page_numel."""
        views = []
        for a_seg, bt_seg in zip(self.segments[0::2], self.segments[1::2]):
            views.append(tuple(pool[:, s.offset: s.offset + s.numel].unflatten(1, (s.rows, s.cols))
                               for s in (a_seg, bt_seg)))
        return views

    def pack(self, parts: Mapping[str, tuple[torch.Tensor, torch.Tensor, int, float]],
             pages: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pack {module: (A 1-D [r * in], B 1-D row-major [out * r], r, scale)} into `pages` (each a 1-D
        [page_numel] view, enough for the largest r); return the scales [n_modules] float32. Modules the
        adapter does not target stay zero with scale 0.

        Each module takes two slices per page (A's rows, and Bᵀ's rows as a transposed view of B's columns), and
        the whole pack is one zero_ per page and one multi-tensor copy: few GIL handoffs however many modules (see
        AdapterFile), and little Python per module, which runs holding the GIL the engine thread needs.
        """
        rows = self.page_rows
        need = self.pages_for(max((part[2] for part in parts.values()), default=1))
        if need > len(pages):
            raise ValueError(f"the adapter needs {need} pages of {rows} rank rows; {len(pages)} were reserved "
                             "(its rank changed since registration?)")
        dst, src = [], []
        scales = [0.0] * len(self.modules)
        for module, (a, b, rank, scale) in parts.items():
            index = self.module_index[module]
            in_features, out_features = self.shapes[module]
            a_seg, bt_seg = self.segments[2 * index], self.segments[2 * index + 1]
            b_rows = b.view(out_features, rank)
            for page, lo in enumerate(range(0, rank, rows)):
                n = min(rows, rank - lo)
                dst.append(pages[page][a_seg.offset: a_seg.offset + n * in_features])
                src.append(a[lo * in_features: (lo + n) * in_features])
                dst.append(pages[page][bt_seg.offset: bt_seg.offset + n * out_features].view(n, out_features))
                src.append(b_rows[:, lo: lo + n].t())  # Bᵀ's rows lo..lo+n: B's columns, one strided copy
            scales[index] = scale
        for page in pages:
            page.zero_()
        if dst:
            torch._foreach_copy_(dst, src)
        return torch.tensor(scales, dtype=torch.float32)
