"""Segmented multi-adapter LoRA (the SGMV idea of Punica) over paged adapter memory: a shrink and an
expand kernel in Triton, next to `lora_reference`, the plain-torch loop they replace, and `host_lora`, which
computes that loop alike over segments read once a step (the engine's CPU path). This module holds their launch
configs and launchers; the Triton programs themselves are in app/model/kernels/lora_triton.py.

    # Per-step metadata, shared by every layer of one forward:
    #   token_order [T_cap] int32: token indices grouped by segment (a permutation of the real tokens, padded)
    #   seg_starts  [S_cap + 1] int32: segment i covers token_order[seg_starts[i] : seg_starts[i+1]]
    #   seg_slots   [S_cap] int32: the adapter slot of segment i; -1 = no adapter (base rows, or padding
    #               segments, which are empty)
    # Adapter weights live in pages of rank rows (prefetch/layout.py); for one target linear:
    #   A  [num_pages, P, in_features]   (page p's P rank rows of A; a strided view of the page pool)
    #   BT [num_pages, P, out_features]  (the same rows of B transposed)
    #   page_table [num_slots, max_pages] int32: slot s's rank row r lives in page page_table[s, r // P],
    #              at row r % P
    #   slot_ranks [num_slots] int32: each slot's rank; rows >= rank are never read
    #   scales [num_slots] float32 (this module's lora_alpha / r per slot; 0 for a module the adapter skips)
    def rows(W, s):  # the adapter's [rank, features] matrix, gathered from its pages
        return stack([W[page_table[s, r // P], r % P] for r in range(slot_ranks[s])])
    for i in range(S):
        s = seg_slots[i]
        if s < 0: continue
        for t in token_order[seg_starts[i]:seg_starts[i+1]]:
            y[t] += scales[s] * (x[t] @ rows(A, s).T) @ rows(BT, s)

x is [T, in], y is [T, out] (same dtype: bf16, fp16 or fp32), y is updated in place, sums run in fp32.

A `Group` runs that loop for up to three target linears that read the same x and write column ranges of
one y (q, k and v over their fused GEMM's output; gate and up): one shrink and one expand launch for all
of them, each program picking its member from its grid index. scales are then [n_modules, num_slots].

On CUDA, `lora_shrink` writes split-K partials of x @ A[s].T into a preallocated fp32 workspace
[members x splits, T_cap, max(16, max_rank)] (no atomics, no memset), on a grid (segment, member x K split,
M program); `lora_expand` sums the partials as it loads them and adds scale * xa @ BT[s] into y, on a grid
(segment, out tile of any member, M program). Each program gathers its A (or BT) rows through the page
table once (the page-table load goes out with the rank load, so paging adds no step to the chain of loads)
and loops over its M tiles of the segment (all of them in decode, where there is one M program; prefill
strides them over a few programs that share the tile through L2), so the bytes read grow with the
distinct adapters in the batch and their ranks, not with num_slots. Grids depend on static shapes only
and loop bounds come from the metadata tensors, so both kernels replay under a CUDA graph; a segment
with slot -1 or no tokens exits at once. Written by hand: no maintained library offers a
graph-capturable segmented LoRA op over paged weights in Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

try:
    import triton
except ImportError:  # CPU installs carry no triton: only `lora_reference` is usable there
    triton = None
else:
    from app.model.kernels.lora_triton import _expand_kernel, _shrink_kernel

DECODE_T_MAX = 256  # a step of at most this many tokens uses the decode config (a graph bucket: any size)


def gather_rows(W: torch.Tensor, page_table: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """Slot `slot`'s [rank, features] rows of W [num_pages, P, features]."""
    page_rows = W.shape[1]
    pages = page_table[slot, : -(-rank // page_rows)].long()
    return W.index_select(0, pages).flatten(0, 1)[:rank]


def lora_reference(y, x, A, BT, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots) -> None:
    """The loop of the module docstring in plain torch, one gather/matmul/scatter per segment."""
    starts, slots, scale_of = seg_starts.tolist(), seg_slots.tolist(), scales.tolist()
    for i, slot in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if slot < 0 or hi <= lo:
            continue
        rank = int(slot_ranks[slot])
        rows = token_order[lo:hi].long()
        xa = x.index_select(0, rows).float() @ gather_rows(A, page_table, slot, rank).float().T  # [n, rank]
        delta = (xa @ gather_rows(BT, page_table, slot, rank).float()) * scale_of[slot]  # [n, out]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


@dataclass(frozen=True)
class HostSegment:
    """One adapter segment of a step on the CPU path, with what the side tables say of its slot. Read once a step
    (`host_segments`), not in each of the step's LoRA calls, as `lora_reference` reads them: in the
    tiny models of the CPU path those reads cost more than the matmuls."""

    rows: slice | torch.Tensor  # the segment's tokens: a slice where they are consecutive, else their indices
    rank: int
    pages: torch.Tensor  # [max_pages] int64: the slot's page table row
    scales: tuple[float, ...]  # the slot's scale for each module


def rank_rows(W: torch.Tensor, segment: HostSegment) -> torch.Tensor:
    """The segment's adapter's [rank, features] rows of W [num_pages, P, features]."""
    return W.index_select(0, segment.pages[: -(-segment.rank // W.shape[1])]).flatten(0, 1)[: segment.rank]


def host_segments(token_order, seg_starts, seg_slots, slot_ranks, page_table, scales) -> tuple[HostSegment, ...]:
    """The step's adapter segments with their slots' ranks, pages and scales, for `host_lora`. scales: [n_modules,
    num_slots]."""
    order, starts, slots = token_order.tolist(), seg_starts.tolist(), seg_slots.tolist()
    out = []
    for i, slot in enumerate(slots):
        lo, hi = starts[i], starts[i + 1]
        if slot < 0 or hi <= lo:
            continue
        tokens = order[lo:hi]  # increasing (lora.py's `segments`): consecutive where its ends are hi - lo - 1 apart
        rows = slice(tokens[0], tokens[-1] + 1) if tokens[-1] - tokens[0] == hi - lo - 1 else \
            torch.tensor(tokens, dtype=torch.long, device=slot_ranks.device)
        out.append(HostSegment(rows, int(slot_ranks[slot]), page_table[slot].long(), tuple(scales[:, slot].tolist())))
    return tuple(out)


def host_lora(y: torch.Tensor, x: torch.Tensor, group: Group, segments: tuple[HostSegment, ...]) -> None:
    """`lora_group_reference` over segments read once a step: the same sums, in float32, in the same order."""
    for A, BT, module, column in zip(group.A, group.BT, group.modules, group.columns):
        out = y[:, column: column + BT.shape[2]]
        for segment in segments:
            xa = x[segment.rows].float() @ rank_rows(A, segment).float().T  # [n, rank]
            delta = (xa @ rank_rows(BT, segment).float()) * segment.scales[module]  # [n, out]
            if out.dtype == torch.float32:  # no rounding to undo: add in place (rows are distinct)
                if isinstance(segment.rows, slice):
                    out[segment.rows] += delta
                else:
                    out.index_add_(0, segment.rows, delta)
            elif isinstance(segment.rows, slice):
                out[segment.rows] = (out[segment.rows].float() + delta).to(out.dtype)
            else:
                out.index_copy_(0, segment.rows, (out.index_select(0, segment.rows).float() + delta).to(out.dtype))


@dataclass(frozen=True)
class KernelConfig:
    """Tile choices for one token bucket. Decode programs are latency-bound (a chain of dependent loads
    from the metadata to the weights), so fewer, larger programs win; prefill needs programs along M."""

    target_splits: int  # K splits the shrink aims for (rounded to a power-of-two BLOCK_K)
    block_m: int  # tokens per tile, >= 16 for tl.dot
    block_n: int  # output columns per expand program
    num_warps: int
    num_stages: int = 1
    m_programs: int = 1  # programs per segment along M, each striding over the segment's M tiles

    def __post_init__(self):
        if min(self.target_splits, self.num_stages, self.m_programs) < 1:
            raise ValueError(f"target_splits ({self.target_splits}), num_stages ({self.num_stages}) and "
                             f"m_programs ({self.m_programs}) must be >= 1")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two >= 16")


DECODE = KernelConfig(target_splits=8, block_m=16, block_n=256, num_warps=4, num_stages=1)
PREFILL = KernelConfig(target_splits=8, block_m=64, block_n=128, num_warps=4, num_stages=2, m_programs=4)
SHRINK_SMEM = 64 * 1024  # bytes of A tile + x tile per shrink program
EXPAND_BT_SMEM = 32 * 1024  # bytes of the BT tile per expand program


def pick_config(t_cap: int) -> KernelConfig:
    return DECODE if t_cap <= DECODE_T_MAX else PREFILL


PREFILL_M_PROGRAMS = (4, 8, 16)


def prefill_m_programs(rows: int, config: KernelConfig = PREFILL) -> int:
    """Programs along M for an eager step whose longest segment has `rows` tokens: one per 4 of its M tiles, a
    power of two within PREFILL_M_PROGRAMS. With 4, one adapter's 4096-token chunk leaves most of the GPU idle: its
    LoRA over 32 layers takes 19.4 ms on an H200, 11.2 with 16 programs, while 8 segments of 512 tokens run best
    with 4 (`python -m bench.kernel.lora_prefill --distinct 1 2 8 --m-programs 8 16 32`)."""
    tiles = -(-rows // config.block_m)
    return min(PREFILL_M_PROGRAMS[-1], max(PREFILL_M_PROGRAMS[0], _next_pow2(-(-tiles // 4))))


def prefill_rows(m_programs: int, config: KernelConfig = PREFILL) -> int:
    """The fewest rows for which `prefill_m_programs` gives m_programs."""
    return 1 if m_programs == PREFILL_M_PROGRAMS[0] else 2 * m_programs * config.block_m + 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_r(max_rank: int) -> int:
    return max(16, _next_pow2(max_rank))


def shrink_tiles(in_features: int, block_r: int, elsize: int, config: KernelConfig) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the shrink; one K block per program, shrunk to fit SHRINK_SMEM."""
    block_k = min(1024, max(16, _next_pow2(-(-in_features // config.target_splits))))
    while block_k > 16 and (block_r + 16) * block_k * elsize > SHRINK_SMEM:
        block_k //= 2
    block_m = max(16, min(config.block_m, 16384 // block_k))
    while block_m > 16 and (block_r + block_m) * block_k * elsize > SHRINK_SMEM:
        block_m //= 2
    return block_m, block_k


def expand_tiles(block_r: int, elsize: int, config: KernelConfig) -> tuple[int, int]:
    """(BLOCK_N, num_stages) of the expand; fp32 and large ranks get narrower tiles and no pipelining."""
    block_n = config.block_n
    while block_n > 16 and block_r * block_n * elsize > EXPAND_BT_SMEM:
        block_n //= 2
    return block_n, config.num_stages if elsize * block_r <= 32 else 1


def shrink_splits(in_features: int, block_r: int, elsize: int, config: KernelConfig) -> int:
    return -(-in_features // shrink_tiles(in_features, block_r, elsize, config)[1])


MAX_MEMBERS = 3  # q, k and v


@dataclass(frozen=True)
class Group:
    """Target linears that read the same x and write column ranges of one y, as one shrink and one expand
    launch: q, k and v (or gate and up) over their fused GEMM's output, or one linear alone. Their A and BT
    are views of the same page pool (prefetch/layout.py), so a member is its offset from the first one."""

    A: tuple[torch.Tensor, ...]  # per member [num_pages, P, in]: the same shape and strides
    BT: tuple[torch.Tensor, ...]  # per member [num_pages, P, out_g]: the same page stride
    modules: tuple[int, ...]  # each member's row of the scales [n_modules, num_slots]
    columns: tuple[int, ...]  # each member's first column in y

    def __post_init__(self):
        n = len(self.A)
        if not 1 <= n <= MAX_MEMBERS or not len(self.BT) == len(self.modules) == len(self.columns) == n:
            raise ValueError(f"a group has 1 to {MAX_MEMBERS} members with A, BT, module and column each, got "
                             f"{len(self.A)}, {len(self.BT)}, {len(self.modules)}, {len(self.columns)}")
        a0, b0 = self.A[0], self.BT[0]
        for a, bt in zip(self.A, self.BT):
            if (a.shape, a.stride()) != (a0.shape, a0.stride()) or bt.shape[:2] != b0.shape[:2] \
                    or bt.stride()[::2] != (b0.stride(0), 1) or a.dtype != a0.dtype or bt.dtype != a0.dtype:
                raise ValueError("a group's members need A views of one shape and strides and BT views of one "
                                 "page stride, in one dtype")
            if a.untyped_storage().data_ptr() != a0.untyped_storage().data_ptr() or \
                    bt.untyped_storage().data_ptr() != b0.untyped_storage().data_ptr():
                raise ValueError("a group's members must be views of one page pool")

    @classmethod
    def single(cls, A: torch.Tensor, BT: torch.Tensor, module: int = 0) -> Group:
        return cls((A,), (BT,), (module,), (0,))

    def offsets(self, views) -> list[int]:
        """Each member's element offset from the first member's view."""
        first = views[0]
        return [(v.data_ptr() - first.data_ptr()) // v.element_size() for v in views]


@dataclass(frozen=True)
class LoRAWorkspace:
    """Split-K partials of x @ A.T for each member of a group, allocated once and shared by every layer (and
    bucket) of a forward."""

    xa: torch.Tensor  # [MAX_MEMBERS * max_splits, t_cap, max(16, max_rank)] float32

    @classmethod
    def allocate(cls, t_cap: int, max_rank: int, in_features: Sequence[int], device,
                 configs: Sequence[KernelConfig] = (DECODE, PREFILL), members: int = MAX_MEMBERS) -> LoRAWorkspace:
        """Sized for buckets of up to t_cap tokens, every target's in_features, any dtype, under `configs`,
        and groups of up to `members` linears."""
        block_r = _block_r(max_rank)
        splits = max(shrink_splits(k, block_r, elsize, c) for k in in_features for c in configs for elsize in (2, 4))
        return cls(torch.empty(members * splits, t_cap, block_r, dtype=torch.float32, device=device))


def _max_rows(weights, page_table) -> int:
    """Rank rows a slot can address: its page table row's pages of P rows."""
    return page_table.shape[1] * weights.shape[1]


def _check(x_or_y, weights, page_table, token_order, workspace, rows_needed):
    if token_order.dtype != torch.int32 or page_table.dtype != torch.int32:
        raise ValueError(f"metadata must be int32, got token_order {token_order.dtype}, page_table {page_table.dtype}")
    if x_or_y.dtype != weights.dtype:
        raise ValueError(f"activation dtype {x_or_y.dtype} != weight dtype {weights.dtype}")
    if x_or_y.stride(-1) != 1 or weights.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("activations, weights and the page table need a contiguous last dimension")
    ws_rows, ws_t, ws_rank = workspace.xa.shape
    block_r = _block_r(_max_rows(weights, page_table))
    if rows_needed > ws_rows or token_order.numel() > ws_t or block_r > ws_rank:
        raise ValueError(f"workspace [members x splits {ws_rows}, t_cap {ws_t}, rank tile {ws_rank}] is smaller "
                         f"than this call's [{rows_needed}, t_cap {token_order.numel()}, rank tile {block_r}]")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 tests expect fp32 sums; bf16/fp16 ignore it


def _pad3(values: Sequence[int], fill: int = 0) -> list[int]:
    return list(values) + [fill] * (MAX_MEMBERS - len(values))


def lora_shrink(x, group: Group, slot_ranks, page_table, token_order, seg_starts, seg_slots,
                workspace: LoRAWorkspace, config: KernelConfig | None = None) -> int:
    """workspace.xa[g * splits + j, p] = x[token_order[p]] @ rows(A_g, s)[:, K-split j].T for every member g
    and every position p of an adapter segment. Returns the split count, which `lora_expand` must be given."""
    config = config or pick_config(token_order.numel())
    A = group.A[0]
    in_features, max_rows = A.shape[2], _max_rows(A, page_table)
    block_r = _block_r(max_rows)
    block_m, block_k = shrink_tiles(in_features, block_r, A.element_size(), config)
    splits, members = -(-in_features // block_k), len(group.A)
    _check(x, A, page_table, token_order, workspace, members * splits)
    _, off1, off2 = _pad3(group.offsets(group.A))
    ws = workspace.xa
    _shrink_kernel[(seg_slots.numel(), members * splits, config.m_programs)](
        x, A, ws, slot_ranks, page_table, token_order, seg_starts, seg_slots,
        in_features, x.stride(0), A.stride(0), A.stride(1), page_table.stride(0), ws.stride(0), ws.stride(1),
        off1, off2, SPLITS=splits,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, PAGE_ROWS=A.shape[1], MAX_ROWS=max_rows,
        M_PROGRAMS=config.m_programs,
        PRECISION=_precision(x.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
    return splits


def lora_expand(y, group: Group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots,
                workspace: LoRAWorkspace, splits: int, config: KernelConfig | None = None) -> None:
    """y[t, columns_g + n] += scales[modules_g, s] * (sum over splits of workspace.xa[g * splits :, p])
    @ rows(BT_g, s)[:, n] for every member g, t = token_order[p]. scales: [n_modules, num_slots]."""
    config = config or pick_config(token_order.numel())
    BT = group.BT[0]
    _check(y, BT, page_table, token_order, workspace, len(group.BT) * splits)
    max_rows = _max_rows(BT, page_table)
    block_r = _block_r(max_rows)
    block_n, num_stages = expand_tiles(block_r, BT.element_size(), config)
    widths = [bt.shape[2] for bt in group.BT]
    tiles = [triton.cdiv(n, block_n) for n in widths]
    firsts = [0, tiles[0], tiles[0] + (tiles[1] if len(tiles) > 1 else 1 << 20)]  # member g's first tile
    n0, n1, n2 = _pad3(widths)
    c0, c1, c2 = _pad3(group.columns)
    _, o1, o2 = _pad3(group.offsets(group.BT))
    r0, r1, r2 = _pad3([bt.stride(1) for bt in group.BT])
    m0, m1, m2 = _pad3(group.modules)
    if scales.dim() != 2:
        raise ValueError(f"scales must be [n_modules, num_slots], got {tuple(scales.shape)}")
    ws = workspace.xa
    grid = (seg_slots.numel(), sum(tiles), config.m_programs)
    _expand_kernel[grid](
        y, BT, ws, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots,
        y.stride(0), BT.stride(0), page_table.stride(0), ws.stride(0), ws.stride(1), scales.stride(0),
        n0, n1, n2, c0, c1, c2, o1, o2, r0, r1, r2, m0, m1, m2,
        FIRST1=firsts[1], FIRST2=firsts[2],
        SPLITS=splits, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_R=block_r, PAGE_ROWS=BT.shape[1],
        MAX_ROWS=max_rows, M_PROGRAMS=config.m_programs,
        PRECISION=_precision(y.dtype), num_warps=config.num_warps, num_stages=num_stages)


def lora_group_apply(y, x, group: Group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots,
                     workspace: LoRAWorkspace, config: KernelConfig | None = None) -> None:
    """The module docstring's loop for every member of a group on CUDA: one shrink launch, one expand launch."""
    splits = lora_shrink(x, group, slot_ranks, page_table, token_order, seg_starts, seg_slots, workspace, config)
    lora_expand(y, group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots, workspace, splits,
                config)


def lora_group_reference(y, x, group: Group, scales, slot_ranks, page_table, token_order, seg_starts,
                         seg_slots) -> None:
    """`lora_reference` for each member of a group, on its columns of y."""
    for A, BT, module, column in zip(group.A, group.BT, group.modules, group.columns):
        lora_reference(y[:, column: column + BT.shape[2]], x, A, BT, scales[module], slot_ranks, page_table,
                       token_order, seg_starts, seg_slots)


def lora_apply(y, x, A, BT, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots,
               workspace: LoRAWorkspace, config: KernelConfig | None = None) -> None:
    """One target linear: `lora_group_apply` with a group of one (scales [num_slots])."""
    lora_group_apply(y, x, Group.single(A, BT), scales[None], slot_ranks, page_table, token_order, seg_starts,
                     seg_slots, workspace, config)
