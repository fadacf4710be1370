"""The LoRA layer over device slots: token segments, and wrapped linears against the per-row loop."""

import torch
from torch import nn

from app.lora import LoRAContext, LoRALinear, LoRAMetadata, segments


def test_segments_group_tokens_by_slot_and_pad():
    order, starts, slots = segments([2, -1, 0, 2, 2, 0], t_cap=8, s_cap=4)
    assert order == [0, 3, 4, 2, 5, 0, 0, 0]
    assert starts == [0, 3, 5, 5, 5] and slots == [2, 0, -1, -1]


def test_wrapped_linear_equals_the_per_token_loop_with_mixed_ranks():
    gen = torch.Generator().manual_seed(0)
    slots, max_rank, n_in, n_out = 4, 16, 32, 24
    base = nn.Linear(n_in, n_out, bias=False)
    A = torch.zeros(slots, max_rank, n_in)
    BT = torch.zeros(slots, max_rank, n_out)
    ranks = [4, 16, 8, 16]
    for s, r in enumerate(ranks):  # rows past an adapter's rank stay zero, as the slot layout pads them
        A[s, :r] = torch.randn(r, n_in, generator=gen)
        BT[s, :r] = torch.randn(r, n_out, generator=gen)
    ctx = LoRAContext(slots, 1, max_rank, use_kernel=False, device=torch.device("cpu"), workspace=None)
    ctx.scales[0] = torch.tensor([0.5, 2.0, 1.0, 4.0])
    layer = LoRALinear(base, A, BT, 0, ctx)
    token_slots = [2, -1, 0, 2, 3, 1, 1]
    order, starts, seg_slots = segments(token_slots, 7, 7)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ctx.meta = LoRAMetadata(t(order), t(starts), t(seg_slots))
    x = torch.randn(1, 7, n_in, generator=gen)
    with torch.no_grad():
        got = layer(x)[0]
        for i, s in enumerate(token_slots):
            expected = base(x[0, i])
            if s >= 0:
                r = ranks[s]
                expected = expected + ctx.scales[0, s] * (x[0, i] @ A[s, :r].T) @ BT[s, :r]
            torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-4)  # float32 summation order
