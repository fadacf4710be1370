"""Batched multi-adapter LoRA over the device slots: every token may use a different adapter.

Each target linear of the base model is wrapped: y = base(x), then for every token t whose sequence
runs on slot s,
    y[t] += scale[s] * (x[t] @ A[s].T) @ BT[s]
through the segmented kernels of app/kernels/lora.py: tokens are grouped into segments by slot once per
step (`LoRAMetadata`), and each segment's adapter is read once, so the cost grows with the distinct
adapters in the batch, not with the slot count. CUDA runs the Triton pair (capturable in a CUDA graph);
CPU runs its plain-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.kernels import lora as kernels
from prefetch.layout import SlotLayout


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


class LoRAContext:
    """Per-forward routing shared by every wrapped layer, and the slot weights' side tables."""

    def __init__(self, num_slots: int, n_modules: int, max_rank: int, use_kernel: bool, device: torch.device,
                 workspace: kernels.LoRAWorkspace | None):
        self.meta: LoRAMetadata | None = None
        self.use_kernel = use_kernel
        self.workspace = workspace
        self.scales = torch.zeros(n_modules, num_slots, dtype=torch.float32, device=device)  # [module, slot]
        # Each slot's rank, so the kernels skip an adapter's padding rows (a rank-8 adapter in rank-16 slots
        # reads half the bytes). Padding rows are zero, so max_rank is always correct; a load writes the real one.
        self.slot_ranks = torch.full((num_slots,), max_rank, dtype=torch.int32, device=device)

    def apply(self, y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, BT: torch.Tensor, module_index: int) -> None:
        meta = self.meta
        if self.use_kernel:
            kernels.lora_apply(y, x, A, BT, self.scales[module_index], self.slot_ranks, meta.token_order,
                               meta.seg_starts, meta.seg_slots, self.workspace)
        else:
            kernels.lora_reference(y, x, A, BT, self.scales[module_index], meta.token_order, meta.seg_starts,
                                   meta.seg_slots)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, A: torch.Tensor, BT: torch.Tensor, module_index: int, ctx: LoRAContext):
        super().__init__()
        self.base = base
        self.A = A  # [num_slots, max_rank, in_features]
        self.BT = BT  # [num_slots, max_rank, out_features]
        self.module_index = module_index
        self.ctx = ctx

    @torch.compiler.disable  # opaque to the model runner's torch.compile: a GEMM plus our Triton kernels
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.ctx.meta is not None:
            self.ctx.apply(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.A, self.BT, self.module_index)
        return y


class LoRASlots:
    """Wraps the model's target linears and owns the slot tensors they read."""

    def __init__(self, model: nn.Module, layout: SlotLayout, num_slots: int, t_cap: int):
        param = next(model.parameters())
        self.layout, self.num_slots = layout, num_slots
        self.device, self.dtype = param.device, param.dtype
        use_kernel = self.device.type == "cuda" and kernels.triton is not None
        workspace = None
        if use_kernel:
            in_features = sorted({shape[0] for shape in layout.shapes.values()})
            workspace = kernels.LoRAWorkspace.allocate(t_cap, layout.max_rank, in_features, self.device)
        self.ctx = LoRAContext(num_slots, len(layout.modules), layout.max_rank, use_kernel, self.device, workspace)
        self._slot_views: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
        for index, module in enumerate(layout.modules):
            in_features, out_features = layout.shapes[module]
            A = torch.zeros(num_slots, layout.max_rank, in_features, dtype=self.dtype, device=self.device)
            BT = torch.zeros(num_slots, layout.max_rank, out_features, dtype=self.dtype, device=self.device)
            parent_name, _, child = module.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), A, BT, index, self.ctx))
            for slot in range(num_slots):
                self._slot_views[slot] += [A[slot], BT[slot]]  # layout order: A then BT per module

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slot_views[0]) * self.num_slots

    def write_slot(self, slot: int, flat: torch.Tensor, scales: torch.Tensor, rank: int = 0) -> None:
        """Runs on the copy stream (CUDA): the same slot tensors the captured graphs read, ordered by events.
        rank: the adapter's largest rank (0: unknown), so the kernels read no padding rows."""
        torch._foreach_copy_(self._slot_views[slot], self.layout.views(flat), non_blocking=True)
        self.ctx.scales[:, slot].copy_(scales, non_blocking=True)
        self.ctx.slot_ranks[slot].fill_(rank if 0 < rank <= self.layout.max_rank else self.layout.max_rank)
