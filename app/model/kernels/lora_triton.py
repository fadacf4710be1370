"""The Triton programs behind `lora_shrink` and `lora_expand` (app/model/kernels/lora.py states what they compute,
picks their tiles and launches them). Imported only where triton is installed."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _member(g, v0, v1, v2):
    """Member g's value of a per-member scalar (groups have at most three members)."""
    return tl.where(g == 0, v0, tl.where(g == 1, v1, v2))


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, ws_ptr, ranks_ptr, pages_ptr, order_ptr, starts_ptr, slots_ptr,
                   K, stride_xt, stride_ap, stride_ar, stride_pt, stride_wsj, stride_wsp, a_off1, a_off2,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   PAGE_ROWS: tl.constexpr, MAX_ROWS: tl.constexpr,
                   M_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    row = tl.program_id(1)  # member g's K split j: workspace row g * SPLITS + j
    slot = tl.load(slots_ptr + seg)  # the three loads go out together: branch only after
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    first = start + tl.program_id(2) * BLOCK_M  # this program's first M tile
    if (slot < 0) | (end <= first):
        return
    g = row // SPLITS
    split = row - g * SPLITS
    offs_r = tl.arange(0, BLOCK_R)
    rank = tl.load(ranks_ptr + slot)  # the rank and page loads go out together
    page = tl.load(pages_ptr + slot.to(tl.int64) * stride_pt + offs_r // PAGE_ROWS, mask=offs_r < MAX_ROWS,
                   other=0)
    member = _member(g, 0, a_off1, a_off2).to(tl.int64)
    rows = member + page.to(tl.int64) * stride_ap + (offs_r % PAGE_ROWS) * stride_ar  # [BLOCK_R] row offsets
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    r_mask = offs_r < rank  # rows past the rank are never read: a rank-8 adapter costs half a rank-16 one
    a = tl.load(a_ptr + rows[:, None] + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_K], read once
    a_t = tl.trans(a)
    ws_row = ws_ptr + row * stride_wsj
    for m0 in range(first, end, BLOCK_M * M_PROGRAMS):
        pos = m0 + tl.arange(0, BLOCK_M)
        m_mask = pos < end
        tok = tl.load(order_ptr + pos, mask=m_mask, other=0).to(tl.int64)
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        part = tl.dot(xt, a_t, input_precision=PRECISION)  # [BLOCK_M, BLOCK_R] fp32
        # columns past the rank hold zeros (A's rows were masked), so the expand reads whole rows
        tl.store(ws_row + pos[:, None] * stride_wsp + offs_r[None, :], part, mask=m_mask[:, None])


@triton.jit
def _expand_kernel(y_ptr, bt_ptr, ws_ptr, scales_ptr, ranks_ptr, pages_ptr, order_ptr, starts_ptr, slots_ptr,
                   stride_yt, stride_bp, stride_pt, stride_wsj, stride_wsp, stride_sm,
                   n0, n1, n2, col0, col1, col2, bt_off1, bt_off2, stride_br0, stride_br1, stride_br2,
                   mod0, mod1, mod2, FIRST1: tl.constexpr, FIRST2: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PAGE_ROWS: tl.constexpr, MAX_ROWS: tl.constexpr,
                   M_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    tile = tl.program_id(1)  # output tiles of member 0, then member 1's, then member 2's
    slot = tl.load(slots_ptr + seg)  # the three loads go out together: branch only after
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    first = start + tl.program_id(2) * BLOCK_M  # this program's first M tile
    if (slot < 0) | (end <= first):
        return
    g = (tile >= FIRST1).to(tl.int32) + (tile >= FIRST2).to(tl.int32)
    n_tile = tile - _member(g, 0, FIRST1, FIRST2)
    N = _member(g, n0, n1, n2)
    stride_br = _member(g, stride_br0, stride_br1, stride_br2).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rank = tl.load(ranks_ptr + slot)  # the rank, scale and page loads go out together
    scale = tl.load(scales_ptr + _member(g, mod0, mod1, mod2).to(tl.int64) * stride_sm + slot)
    page = tl.load(pages_ptr + slot.to(tl.int64) * stride_pt + offs_r // PAGE_ROWS, mask=offs_r < MAX_ROWS,
                   other=0)
    member = _member(g, 0, bt_off1, bt_off2).to(tl.int64)
    rows = member + page.to(tl.int64) * stride_bp + (offs_r % PAGE_ROWS) * stride_br  # [BLOCK_R] row offsets
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    r_mask = offs_r < rank
    bt = tl.load(bt_ptr + rows[:, None] + offs_n[None, :],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N], read once
    cols = _member(g, col0, col1, col2) + offs_n
    ws_member = ws_ptr + g * SPLITS * stride_wsj
    for m0 in range(first, end, BLOCK_M * M_PROGRAMS):
        pos = m0 + tl.arange(0, BLOCK_M)
        m_mask = pos < end
        tok = tl.load(order_ptr + pos, mask=m_mask, other=0).to(tl.int64)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + cols[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
        xa_ptrs = ws_member + pos[:, None] * stride_wsp + offs_r[None, :]
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for j in tl.static_range(SPLITS):  # unrolled: every partial's load is in flight at once
            xa += tl.load(xa_ptrs + j * stride_wsj, mask=m_mask[:, None], other=0.0)
        xa = (xa * scale).to(bt.dtype)
        delta = tl.dot(xa, bt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        tl.store(y_ptrs, (y_old.to(tl.float32) + delta).to(y_old.dtype), mask=y_mask)
