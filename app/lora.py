"""Batched multi-adapter LoRA over paged device memory: every token may use a different adapter.

Each target linear of the base model is wrapped: y = base(x), then for every token t whose sequence
runs on slot s,
    y[t] += scale[s] * (x[t] @ A_s.T) @ BT_s
where A_s and BT_s are slot s's rank rows, gathered from its pages of the shared page pool through the
page table (prefetch/layout.py), by the segmented kernels of app/kernels/lora.py: tokens are grouped into
segments by slot once per step (`LoRAMetadata`), and each segment's adapter is read once, so the cost
grows with the distinct adapters in the batch, not with the slot count. CUDA runs the Triton pair
(capturable in a CUDA graph); CPU runs its plain-torch reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from app.kernels import lora as kernels
from prefetch.layout import PageLayout

log = logging.getLogger(__name__)
MAX_RESIDENT_ADAPTERS = 4096  # caps the side tables (and, for tiny adapters on a big GPU, the pool)


@dataclass
class LoRAMetadata:
    token_order: torch.Tensor  # [T_cap] int32: token indices grouped by segment
    seg_starts: torch.Tensor  # [S_cap + 1] int32
    seg_slots: torch.Tensor  # [S_cap] int32, -1: no adapter


def segments(token_slots: list[int], t_cap: int, s_cap: int) -> tuple[list[int], list[int], list[int]]:
    """Group token indices by slot (-1 = base): (token_order [t_cap], seg_starts [s_cap + 1], seg_slots [s_cap]).
    Base tokens are left out; unused entries are padding (empty segments of slot -1)."""
    by_slot: dict[int, list[int]] = {}
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(t)
    assert len(by_slot) <= s_cap, f"{len(by_slot)} distinct adapters > {s_cap} segments"
    order, starts, slots = [], [0], []
    for slot, tokens in by_slot.items():
        order += tokens
        starts.append(len(order))
        slots.append(slot)
    pad = s_cap - len(slots)
    return order + [0] * (t_cap - len(order)), starts + [len(order)] * pad, slots + [-1] * pad


def pool_size(config, layout: PageLayout, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(pages, slots) of the device adapter pool.

    num_slots: that many adapters, each with the pages of a max_rank one (no adapter waits for room while
    a slot is free). Else adapter_memory_bytes, else adapter_memory_fraction of the GPU memory free now
    (after the weights; the KV cache is sized after this), else on CPU the pages of 8 max_rank adapters;
    then any adapter fits in as many pages as its rank needs, as many adapters as the pages hold.
    """
    if config.num_slots is not None:
        return config.num_slots * layout.max_pages, config.num_slots
    page_nbytes = layout.page_nbytes(dtype)
    if config.adapter_memory_bytes is not None:
        nbytes = config.adapter_memory_bytes
    elif device.type == "cuda":
        nbytes = int(torch.cuda.mem_get_info(device)[0] * config.adapter_memory_fraction)
    else:
        nbytes = CPU_DEFAULT_MAX_RANK_ADAPTERS * layout.max_pages * page_nbytes
    pages = min(nbytes // page_nbytes, MAX_RESIDENT_ADAPTERS * layout.max_pages)
    if pages < layout.max_pages:
        raise ValueError(f"adapter memory ({nbytes} bytes) holds {pages} pages of {page_nbytes} bytes; one adapter "
                         f"at max_rank {layout.max_rank} needs {layout.max_pages}")
    return pages, min(pages, MAX_RESIDENT_ADAPTERS)


CPU_DEFAULT_MAX_RANK_ADAPTERS = 8


class LoRAContext:
    """Per-forward routing shared by every wrapped layer, and the slots' side tables."""

    def __init__(self, num_slots: int, n_modules: int, max_pages: int, use_kernel: bool, device: torch.device,
                 workspace: kernels.LoRAWorkspace | None):
        self.meta: LoRAMetadata | None = None
        self.use_kernel = use_kernel
        self.workspace = workspace
        self.scales = torch.zeros(n_modules, num_slots, dtype=torch.float32, device=device)  # [module, slot]
        # Each slot's rank and pages: the kernels read only its rank rows, wherever its pages are.
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)  # [num_slots]
        self.page_table = torch.zeros(num_slots, max_pages, dtype=torch.int32, device=device)  # [num_slots, max_pages]

    def apply(self, y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, BT: torch.Tensor, module_index: int) -> None:
        meta = self.meta
        fn = kernels.lora_apply if self.use_kernel else kernels.lora_reference
        extra = (self.workspace,) if self.use_kernel else ()
        fn(y, x, A, BT, self.scales[module_index], self.slot_ranks, self.page_table, meta.token_order,
           meta.seg_starts, meta.seg_slots, *extra)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, A: torch.Tensor, BT: torch.Tensor, module_index: int, ctx: LoRAContext):
        super().__init__()
        self.base = base
        self.A = A  # [num_pages, page_rows, in_features], a strided view of the page pool
        self.BT = BT  # [num_pages, page_rows, out_features]
        self.module_index = module_index
        self.ctx = ctx

    @torch.compiler.disable  # opaque to the model runner's torch.compile: a GEMM plus our Triton kernels
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.ctx.meta is not None:
            self.ctx.apply(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.A, self.BT, self.module_index)
        return y


class LoRASlots:
    """Wraps the model's target linears and owns the page pool and side tables they read."""

    def __init__(self, model: nn.Module, layout: PageLayout, num_pages: int, num_slots: int, t_cap: int):
        param = next(model.parameters())
        self.layout, self.num_pages, self.num_slots = layout, num_pages, num_slots
        self.device, self.dtype = param.device, param.dtype
        use_kernel = self.device.type == "cuda" and kernels.triton is not None
        workspace = None
        if use_kernel:
            in_features = sorted({shape[0] for shape in layout.shapes.values()})
            workspace = kernels.LoRAWorkspace.allocate(t_cap, layout.max_pages * layout.page_rows, in_features,
                                                       self.device)
        self.ctx = LoRAContext(num_slots, len(layout.modules), layout.max_pages, use_kernel, self.device, workspace)
        # Graphs capture pointers into this pool; loads write into it on the copy stream, ordered by events.
        self.pool = torch.zeros(num_pages, layout.page_numel, dtype=self.dtype, device=self.device)
        for index, (module, (A, BT)) in enumerate(zip(layout.modules, layout.module_views(self.pool))):
            parent_name, _, child = module.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), A, BT, index, self.ctx))
        log.info("adapter pool: %.2f GB in %d pages of %d rank rows (%.1f MB each): %d adapters at max_rank %d, "
                 "up to %d resident", self.nbytes() / 1e9, num_pages, layout.page_rows,
                 layout.page_nbytes(self.dtype) / 1e6, num_pages // layout.max_pages, layout.max_rank, num_slots)

    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def write_slot(self, slot: int, pages, host_pages, scales: torch.Tensor, rank: int) -> None:
        """Runs on the copy stream (CUDA): the same pool and side tables the captured graphs read, ordered by
        events. host_pages[i] (pinned on CUDA) goes to pool page pages[i]."""
        torch._foreach_copy_([self.pool[p] for p in pages], list(host_pages), non_blocking=True)
        row = torch.zeros(self.layout.max_pages, dtype=torch.int32)
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.ctx.page_table[slot].copy_(row, non_blocking=True)
        self.ctx.scales[:, slot].copy_(scales, non_blocking=True)
        self.ctx.slot_ranks[slot].fill_(min(rank, len(pages) * self.layout.page_rows))
