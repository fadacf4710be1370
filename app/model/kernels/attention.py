"""Paged attention over the engine's KV cache: plain-torch references and a GQA-native Triton decode kernel.

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; block 0 is a
scratch block no request owns. Token j of row b lives at block block_tables[b, j // bs], offset j % bs.

Decode semantics (the loop the kernel replaces):

    # q [B, H, D] (one new token per row, already written into the cache), block_tables [B, max_blocks] int32,
    # context_lens [B] int32 (tokens in the cache for row b, the new one included; 0 = a padding row -> output 0)
    G = H // Hkv
    for b in range(B):
        L = context_lens[b]
        keys   = stack(k_cache[block_tables[b, j // bs], j % bs] for j in range(L))  # [L, Hkv, D]
        values = likewise from v_cache
        for h in range(H):
            s = scale * q[b, h] @ keys[:, h // G].T
            if softcap: s = softcap * tanh(s / softcap)
            if window: s[: L - window] = -inf  # the last `window` tokens only, the new one included
            out[b, h] = softmax(s) @ values[:, h // G]

The Triton kernel (flash-decoding split-K): one program per (row, kv head, kv split) loads the G query heads of
its group as one tile, so every K/V token is read once per kv head; a small kernel merges the splits by their
log-sum-exp. It takes head sizes 64, 128 and 256 (Gemma 2 and 3). The grid comes from static shapes only and
lengths are read on the device, so one launch is capturable in a CUDA graph and replays correctly after
context_lens / block_tables change in place.
Written here (no library ships a paged GQA decode kernel for this layout we can depend on).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: only the references are available
    triton = None

_LOG2E = 1.4426950408889634
# Tuned on an H100 at Llama-3-8B shapes (bench/kernel/attention.py --sweep): below one program per SM,
# about four per SM beat two, and 128-token tiles beat 64 on long splits but lose on short ones.
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 64  # a split shorter than one K/V tile wastes a program
_MAX_SPLITS = 64
_LONG_SPLIT_TOKENS = 1024  # from here on, 128-token tiles
HEAD_DIMS = (64, 128, 256)  # the head sizes the Triton kernel takes
# Above head_dim 128 a tile holds proportionally fewer tokens, so its K and V tiles keep the bytes (and the shared
# memory of their pipeline stages) of head_dim 128's: at 256, 64 x 256 where 128 has 128 x 128 (2 stages of K and
# V: 128 KB of an H100 SM's 228 KB). The accumulator, GROUP_PAD x 256 fp32 over 4 warps, is 32 registers a thread;
# the split merge runs 8 warps at 256, so its 64 x 256 partials take the registers 64 x 128 take over 4. (Set by
# this estimate; the tile sweep of bench/kernel/attention.py runs at head_dim 128.)
_TILE_HEAD_DIM = 128


# ---------------------------------------------------------------------------------------------------------
# Plain-torch references (the engine's CPU path and the tests' oracle)
# ---------------------------------------------------------------------------------------------------------

def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A row's first `length` cached tokens as [Hkv, length, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length].transpose(0, 1)


def window_mask(length: int, n: int, window: int | None, device) -> torch.Tensor:
    """[n, length] bool: query t, token length - n + t of its sequence, sees token j when j <= length - n + t
    (causal, bottom-right aligned) and, with a window, j > length - n + t - window (the last `window` tokens,
    its own included: transformers' sliding_window_overlay)."""
    keys = torch.arange(length, device=device)
    queries = torch.arange(length - n, length, device=device)[:, None]
    mask = keys[None, :] <= queries
    if window is not None:
        mask &= keys[None, :] > queries - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
           softcap: float | None = None) -> torch.Tensor:
    """q [H, n, D], k/v [Hkv, L, D] (GQA), mask [n, L] bool or None -> [H, n, D] in q's dtype: softmax of the
    scores, tanh-capped at `softcap` first when given (as transformers' eager Gemma 2 attention), over v."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[0] // k.shape[0]
    scores = (q.float() @ k.float().repeat_interleave(group, 0).transpose(1, 2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float().repeat_interleave(group, 0)).to(q.dtype)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The module docstring's loop, one attention call per row (host loop: syncs; never inside a CUDA graph).

    q [B, H, D]; returns [B, H, D] in q's dtype, computed in fp32.
    """
    out = torch.zeros_like(q)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = _gather_kv(k_cache, block_tables[b], length).float()  # [Hkv, L, D]
        v = _gather_kv(v_cache, block_tables[b], length).float()
        if window is not None:
            k, v = k[:, -window:], v[:, -window:]
        o = attend(q[b].float().unsqueeze(1), k, v, scale, None, softcap)
        out[b] = o.squeeze(1).to(q.dtype)
    return out


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Chunked prefill over several sequences (varlen), their new tokens already written into the cache.

    q [T, H, D]: sequence i's queries are q[query_starts[i]:query_starts[i+1]] (query_starts [S+1]) and are its
    last context_lens[i] - (earlier tokens) cached tokens. Each query attends to every earlier cached token and
    causally to the new ones: query t of n attends to keys j <= context_lens[i] - n + t (bottom-right aligned),
    and with a window only to the last `window` of those. Returns [T, H, D] in q's dtype, computed in fp32.
    """
    out = torch.zeros_like(q)
    starts = query_starts.tolist()
    for i, length in enumerate(context_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        n = last - first
        if n == 0:
            continue
        if n > length:
            raise ValueError(f"sequence {i} has {n} queries but only {length} cached tokens")
        k = _gather_kv(k_cache, block_tables[i], length).float()  # [Hkv, L, D]
        v = _gather_kv(v_cache, block_tables[i], length).float()
        mask = window_mask(length, n, window, q.device)
        o = attend(q[first:last].float().transpose(0, 1), k, v, scale, mask, softcap)  # [H, n, D]
        out[first:last] = o.transpose(0, 1).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# Triton decode
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeWorkspace:
    """Split-K scratch, preallocated once per batch bucket so a captured graph reuses it."""

    partial_out: torch.Tensor  # [B, H, num_splits, D] fp32, each split's normalized output
    partial_lse: torch.Tensor  # [B, H, num_splits] fp32, each split's log2-sum-exp (-inf when empty)

    @property
    def num_splits(self) -> int:
        return self.partial_out.shape[2]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_kv_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device) -> int:
    """Splits per (row, kv head), from static shapes only: about four programs per SM when the batch leaves SMs
    idle, each split at least one tile long."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 132  # Triton's CPU interpreter: pretend an H100 so tests exercise the split path
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    by_occupancy = -(-_PROGRAMS_PER_SM * sms // programs)
    by_length = max(1, max_blocks * block_size // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def decode_workspace(q: torch.Tensor, num_kv_heads: int, block_tables: torch.Tensor, block_size: int,
                     num_splits: int | None = None) -> DecodeWorkspace:
    """Workspace for paged_decode_attention with these static shapes (num_splits: override the heuristic)."""
    batch, num_heads, head_dim = q.shape
    if num_splits is None:
        num_splits = num_kv_splits(batch, num_kv_heads, block_tables.shape[1], block_size, q.device)
    return DecodeWorkspace(
        partial_out=torch.empty(batch, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32),
        partial_lse=torch.empty(batch, num_heads, num_splits, device=q.device, dtype=torch.float32))


def _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [B, H, D] and k/v_cache [blocks, bs, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if head_dim not in HEAD_DIMS or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} in q and cache; got {head_dim} and "
                         f"{k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share bf16 or fp16; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and context_lens must be int32; got {block_tables.dtype}, "
                         f"{context_lens.dtype}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables [{block_tables.shape[0]}, _] and context_lens {tuple(context_lens.shape)} "
                         f"must have batch {batch} rows")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if block_tables.stride(1) != 1 or context_lens.stride(0) != 1:
        raise ValueError("block_tables and context_lens must be contiguous")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, workspace: DecodeWorkspace | None = None, *,
                           window: int | None = None, softcap: float | None = None,
                           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """The module docstring's loop on CUDA, no host syncs; returns out [B, H, D] (q's dtype).

    workspace: from decode_workspace(); its num_splits sets the split count. Without one it is allocated here
    (still capturable, but a graph then owns it). block_n / num_warps / num_stages: tile tuning knobs.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs Triton; on CPU use paged_decode_reference")
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, out)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if workspace is None:
        workspace = decode_workspace(q, num_kv_heads, block_tables, block_size)
    elif workspace.partial_out.shape[:2] != (batch, num_heads) or workspace.partial_out.shape[3] != head_dim:
        raise ValueError(f"workspace {tuple(workspace.partial_out.shape)} does not fit q {tuple(q.shape)}")
    num_splits = workspace.num_splits
    if block_n is None:
        tokens_per_split = block_tables.shape[1] * block_size // num_splits
        block_n = tile_tokens(head_dim, tokens_per_split, block_size)
    split = num_splits > 1
    partial, lse = workspace.partial_out, workspace.partial_lse
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial if split else out, lse,
        scale if softcap else scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        block_tables.shape[1] * block_size, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SPLIT_OUT=split, NUM_STAGES=num_stages, HAS_WINDOW=window is not None,
        SOFTCAP=float(softcap or 0.0), num_warps=num_warps)
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if head_dim <= _TILE_HEAD_DIM else 8)
    return out


def tile_tokens(head_dim: int, tokens_per_split: int, block_size: int) -> int:
    """Tokens per K/V tile: 128 on long splits, else 64, fewer above head_dim 128 (same bytes), at least a block."""
    block_n = 128 if tokens_per_split >= _LONG_SPLIT_TOKENS else 64
    if head_dim > _TILE_HEAD_DIM:
        block_n = block_n * _TILE_HEAD_DIM // head_dim
    return max(block_n, block_size)


if triton is not None:
    _LOG2E_K = tl.constexpr(_LOG2E)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr, qk_scale, window,
                             stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                             stride_btb, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                             stride_lb, stride_lh, max_len, num_splits,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_OUT: tl.constexpr,
                             NUM_STAGES: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.minimum(tl.load(lens_ptr + row), max_len)  # clamp: a bad length must not read past the table
        if HAS_WINDOW:  # the row's last `window` tokens
            first = tl.maximum(length - window, 0)
        else:
            first = 0
        # Splits share the row's attended tokens evenly, in whole tiles; trailing splits may be empty.
        chunk = tl.cdiv(tl.cdiv(length - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, length)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        is_head = g < GROUP
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=is_head[:, None],
                    other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        table = bt_ptr + row * stride_btb
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            is_token = n < end
            block = tl.load(table + n // BLOCK_SIZE, mask=is_token, other=0).to(tl.int64)
            slot = n % BLOCK_SIZE
            k = tl.load(k_ptr + (block * stride_kb + slot * stride_kt + kv_head * stride_kh)[:, None] + d[None, :],
                        mask=is_token[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 units (without SOFTCAP)
            if SOFTCAP > 0:  # SOFTCAP * tanh(s / SOFTCAP), tanh(x) = 2 sigmoid(2x) - 1, then log2 units
                s = (SOFTCAP * _LOG2E_K) * (2.0 * tl.sigmoid(s * (2.0 / SOFTCAP)) - 1.0)
            s = tl.where(is_token[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds at least one token
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (block * stride_vb + slot * stride_vt + kv_head * stride_vh)[:, None] + d[None, :],
                        mask=is_token[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        has_tokens = l > 0
        result = acc / tl.where(has_tokens, l, 1.0)[:, None]  # an empty range leaves acc = 0
        if SPLIT_OUT:
            dst = out_ptr + row * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
            tl.store(dst, result, mask=is_head[:, None])
            lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
            tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=is_head)
        else:
            dst = out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=is_head[:, None])

    @triton.jit
    def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps,
                             stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
                             HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        is_split = s < num_splits
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + s, mask=is_split, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty (padding row): weights all 0
        weight = tl.exp2(lse - top)
        partial = tl.load(partial_ptr + row * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                          mask=is_split[:, None], other=0.0)
        total = tl.sum(weight, 0)
        result = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + d, result.to(out_ptr.dtype.element_ty))
