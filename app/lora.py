"""Batched multi-adapter LoRA: two backends behind one interface, both reading the device slots.

`fused` (default): each target linear adds, for every row i with slot s = slot_of_row[i],
    y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T
computed for all rows at once over the stacked slot tensors, with no loop over adapters:
x is multiplied by every slot's A in one GEMM, a per-row one-hot (times the scale) keeps each
row's own slot, and one more GEMM applies Bᵀ. Decode reads each slot's weights once per step.
`peft`: a PeftModel whose adapters are the slots, run with PEFT's per-row `adapter_names`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from prefetch.layout import SlotLayout

BASE_ROW = None  # slot_of_row entry for a row that uses the base model


def lora_reference(x, A, B, scale):
    """What one row's LoRA delta means: scale * (x @ A.T) @ B.T, with A [r, in] and B [out, r]."""
    return scale * (x @ A.T) @ B.T


class LoRAContext:
    """Per-forward routing shared by every fused layer: which slot each row reads."""

    def __init__(self):
        self.masks: torch.Tensor | None = None  # [n_modules, rows, num_slots]: one-hot(slot) * scale
        self.selected: torch.Tensor | None = None  # [rows, 1, num_slots, 1] bool, float16 only

    def set_rows(self, slot_of_row: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, guard: bool) -> None:
        """slot_of_row: [rows] long, -1 for base rows. scales: [num_slots, n_modules] float32."""
        num_slots = scales.shape[0]
        onehot = F.one_hot(slot_of_row + 1, num_slots + 1)[:, 1:]  # [rows, num_slots]; base rows select nothing
        self.masks = (onehot.unsqueeze(0) * scales.T.unsqueeze(1)).to(dtype)
        # A slot that overflows to inf must not leak NaN (inf * 0) into other rows; only float16
        # can overflow with validated weights, so only float16 pays for the extra select.
        self.selected = onehot.bool()[:, None, :, None] if guard else None

    def clear(self) -> None:
        self.masks = self.selected = None


class FusedLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, A: torch.Tensor, BT: torch.Tensor, module_index: int, ctx: LoRAContext):
        super().__init__()
        self.base = base
        self.A = A  # [num_slots, max_rank, in_features]
        self.BT = BT  # [num_slots, max_rank, out_features]
        self.module_index = module_index
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        masks = self.ctx.masks
        if masks is None:
            return y
        rows, tokens = x.shape[0], x.shape[1]
        slots, rank = self.A.shape[0], self.A.shape[1]
        xa = torch.matmul(x, self.A.view(slots * rank, -1).T).view(rows, tokens, slots, rank)
        xa = xa * masks[self.module_index].view(rows, 1, slots, 1)
        if self.ctx.selected is not None:
            xa = torch.where(self.ctx.selected, xa, 0.0)
        out = torch.addmm(y.view(-1, y.shape[-1]), xa.view(rows * tokens, -1), self.BT.view(slots * rank, -1))
        return out.view_as(y)


def _to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class FusedBackend:
    name = "fused"

    def __init__(self, model: nn.Module, layout: SlotLayout, num_slots: int):
        param = next(model.parameters())
        self.model, self.layout, self.num_slots = model, layout, num_slots
        self.device, self.dtype = param.device, param.dtype
        self.ctx = LoRAContext()
        self.scales = torch.zeros(num_slots, len(layout.modules), dtype=torch.float32, device=self.device)
        self._slot_views: list[list[torch.Tensor]] = [[] for _ in range(num_slots)]
        for index, module in enumerate(layout.modules):
            in_features, out_features = layout.shapes[module]
            A = torch.zeros(num_slots, layout.max_rank, in_features, dtype=self.dtype, device=self.device)
            BT = torch.zeros(num_slots, layout.max_rank, out_features, dtype=self.dtype, device=self.device)
            parent_name, _, child = module.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, FusedLoRALinear(getattr(parent, child), A, BT, index, self.ctx))
            for slot in range(num_slots):
                self._slot_views[slot] += [A[slot], BT[slot]]  # layout order: A then BT per module

    def write_slot(self, slot: int, flat: torch.Tensor, scales: torch.Tensor) -> None:
        torch._foreach_copy_(self._slot_views[slot], self.layout.views(flat), non_blocking=True)
        self.scales[slot].copy_(scales, non_blocking=True)

    def forward(self, slot_of_row: Sequence[int | None], **model_inputs) -> torch.Tensor:
        if all(s is BASE_ROW for s in slot_of_row):
            return self.model(**model_inputs).logits
        rows = _to_device([-1 if s is BASE_ROW else s for s in slot_of_row], self.device)
        self.ctx.set_rows(rows, self.scales, self.dtype, guard=self.dtype == torch.float16)
        try:
            return self.model(**model_inputs).logits
        finally:
            self.ctx.clear()


class PeftBackend:
    """PEFT's own mixed-adapter batch inference; the reference and the baseline."""

    name = "peft"

    def __init__(self, model: nn.Module, layout: SlotLayout, num_slots: int, targets: Sequence[str]):
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=layout.max_rank, lora_alpha=layout.max_rank, lora_dropout=0.0, target_modules=list(targets))
        self.model = get_peft_model(model, config, adapter_name="slot_0")
        for slot in range(1, num_slots):
            self.model.add_adapter(f"slot_{slot}", config)
        self.model.eval()
        self.layout, self.num_slots = layout, num_slots
        self._layers = [self.model.base_model.model.get_submodule(m) for m in layout.modules]
        self._slot_views = []
        with torch.no_grad():
            for slot in range(num_slots):
                name, views = f"slot_{slot}", []
                for layer in self._layers:
                    layer.lora_A[name].weight.zero_()
                    layer.lora_B[name].weight.zero_()
                    views += [layer.lora_A[name].weight, layer.lora_B[name].weight.T]
                self._slot_views.append(views)

    def write_slot(self, slot: int, flat: torch.Tensor, scales: torch.Tensor) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._slot_views[slot], self.layout.views(flat), non_blocking=True)
        for layer, scale in zip(self._layers, scales.tolist()):
            layer.scaling[f"slot_{slot}"] = scale

    def forward(self, slot_of_row: Sequence[int | None], **model_inputs) -> torch.Tensor:
        names = ["__base__" if s is BASE_ROW else f"slot_{s}" for s in slot_of_row]
        return self.model(**model_inputs, adapter_names=names).logits
