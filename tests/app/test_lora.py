"""The fused multi-LoRA layer against its reference loop."""

import torch
from torch import nn

from app.lora import FusedLoRALinear, LoRAContext, lora_reference


def make_layer(slots=4, rank=8, n_in=32, n_out=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(n_in, n_out, bias=False).to(dtype)
    A = torch.randn(slots, rank, n_in, generator=gen).to(dtype)
    BT = torch.randn(slots, rank, n_out, generator=gen).to(dtype)
    ctx = LoRAContext()
    return FusedLoRALinear(base, A, BT, module_index=0, ctx=ctx), ctx


def test_fused_rows_equal_the_reference_loop():
    layer, ctx = make_layer()
    scales = torch.tensor([[0.5], [2.0], [1.0], [4.0]])  # [slots, n_modules]
    slot_of_row = torch.tensor([2, -1, 0, 2, 3])  # -1: a base row
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1))
    ctx.set_rows(slot_of_row, scales, torch.float32, guard=False)
    with torch.no_grad():
        got = layer(x)
        for i, s in enumerate(slot_of_row.tolist()):
            expected = layer.base(x[i])
            if s >= 0:
                expected = expected + lora_reference(x[i], layer.A[s], layer.BT[s].T, scales[s, 0])
            # float32; the tolerance covers summation order (the fused path sums over padded slots)
            torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-4)


def test_float16_guard_keeps_an_overflowing_slot_out_of_other_rows():
    layer, ctx = make_layer(dtype=torch.float16)
    layer.A[1].fill_(60000.0)  # x @ A overflows to inf in this slot only
    scales = torch.ones(4, 1)
    x = torch.randn(2, 1, 32).to(torch.float16)
    ctx.set_rows(torch.tensor([0, -1]), scales, torch.float16, guard=True)
    with torch.no_grad():
        out = layer(x)
    assert torch.isfinite(out).all(), "a foreign slot's inf leaked into other rows"
