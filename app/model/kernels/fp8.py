"""The two Triton kernels around `fp8_linear`'s GEMM (app/model/fp8.py).

`quantize_rows_fused`, its input side, quantizes activations per token in one kernel, exactly as `quantize_rows`
does in plain torch:

    for r in rows:
        scale[r] = max(max(abs(x[r])) * float32(1 / 448), MIN_SCALE)  # float32
        q[r] = round_to_nearest_even(clamp(x[r] / scale[r], -448, 448))  # float8_e4m3fn

Plain torch spends seven kernels on it (a float32 copy of x, abs, amax, two divisions, two clamps and the cast),
each a pass over memory; at decode batch sizes that is seven launches' latency per linear group and layer. Here
each program owns one row: a first pass over it finds the largest magnitude, a second (which reads it back from
L2) scales, clamps and casts. The division is IEEE round-to-nearest, as torch's, so q and scale equal
`quantize_rows`'s bit for bit. Written by hand: torch has no fused per-token FP8 quantization, and running
`quantize_rows` through torch.compile would put a guard check on every eager step's every linear.

`rescale_rows_columns`, its output side at small batches: torch._scaled_mm with row-wise scales runs a kernel
that reads the weight at about half the rate of its one-scale-per-operand (tensor-wise) GEMM when there are few
rows (bench/kernel/fp8.py measures both). For those, fp8_linear runs the tensor-wise GEMM with unit scales into
float32 and this kernel applies both scales (and the bias) in one pass:

    for r in rows: for c in cols:
        y[r, c] = dtype(acc[r, c] * row_scale[r] * column_scale[c] + bias[c])

`scaled_gemm` does both in one kernel: the FP8 product, with the two scales and the bias applied as each output tile
is stored, so no float32 product goes to memory. Each program owns BLOCK_N output columns of every row (BLOCK_M
covers all rows up to 128), so each weight byte is read once, which is what bounds a GEMM over few rows. It is
written by hand because torch has no other FP8 GEMM that takes one scale per row and one per column; `python -m
bench.kernel.fp8 --epilogue-sweep` times it against the two-kernel path. On Hopper its FP8 MMAs sum in fewer bits
than float32 (its outputs lie up to 1.1% of the largest apart from cuBLASLt's at a depth of 14,336), so fp8_linear
does not call it; `GemmConfig.promote_every` adds the partial sums into a float32 accumulator every so many
products, and the sweep times those tilings beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU installs carry no triton; FP8 needs a GPU anyway (app/model/fp8.py)
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12  # a row of zeros gets this scale rather than 0, so that it quantizes to zeros
BLOCK_MAX = 4096  # columns per load: a 14,336-wide row (Llama-3-8B's down projection) takes four
# scaled_gemm's fewest rows per program: on Hopper a tile of 64 rows or more runs on the warp-group MMA instructions
MIN_BLOCK_M = 64

if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q,
                              FP8_LIMIT: tl.constexpr, SCALE_MIN: tl.constexpr, BLOCK: tl.constexpr):
        # the scale is the largest magnitude times float32(1 / FP8_LIMIT), as in quantize_rows
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            v = tl.load(x_row + start + offs, mask=start + offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) * (1.0 / FP8_LIMIT), SCALE_MIN)
        tl.store(scale_ptr + row, scale)
        q_row = q_ptr + row * stride_q
        for start in range(0, cols, BLOCK):
            mask = start + offs < cols
            v = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(libdevice.div_rn(v, scale), -FP8_LIMIT, FP8_LIMIT)
            tl.store(q_row + start + offs, q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _rescale_kernel(acc_ptr, row_scale_ptr, column_scale_ptr, bias_ptr, out_ptr, cols, stride_acc, stride_out,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        acc = tl.load(acc_ptr + row * stride_acc + offs, mask=mask, other=0.0)
        y = acc * tl.load(row_scale_ptr + row) * tl.load(column_scale_ptr + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scaled_gemm_kernel(x_ptr, w_ptr, row_scale_ptr, column_scale_ptr, bias_ptr, out_ptr, rows, cols, depth,
                            stride_x, stride_w, stride_out, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PROMOTE_EVERY: tl.constexpr):
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_in, n_in = offs_m < rows, offs_n < cols
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, depth, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_in[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_in[:, None], other=0.0)
            else:
                k_in = start + offs_k < depth
                x = tl.load(x_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_in[:, None] & k_in[None, :], other=0.0)
            if PROMOTE_EVERY:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_EVERY)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = acc * tl.load(row_scale_ptr + offs_m, mask=m_in, other=0.0)[:, None]
        y = y * tl.load(column_scale_ptr + offs_n, mask=n_in, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def rescale_rows_columns(acc: torch.Tensor, row_scale: torch.Tensor, column_scale: torch.Tensor,
                         bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """acc [R, C] float32, row_scale [R, 1], column_scale [C] (float32), bias [C] or None -> [R, C] in dtype."""
    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=dtype, device=acc.device)
    if rows:
        block = 1024
        _rescale_kernel[(rows, triton.cdiv(cols, block))](
            acc, row_scale, column_scale, bias if bias is not None else acc, out, cols, acc.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def quantize_rows_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] on CUDA (rows contiguous) -> (float8_e4m3fn [R, C], float32 scales [R, 1]), equal to
    `app.model.fp8.quantize_rows(x)`."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(rows, cols, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), BLOCK_MAX)
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), FP8_LIMIT=FP8_MAX,
                                       SCALE_MIN=MIN_SCALE, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, scale


@dataclass(frozen=True)
class GemmConfig:
    """`scaled_gemm`'s tiling: output columns and reduction depth per step of a program, and its launch shape.
    promote_every: on Hopper, add the FP8 MMAs' partial sums into a float32 accumulator after this many products
    of each dot (at most block_k); 0 leaves the whole reduction to the MMAs' own accumulation."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    promote_every: int = 0


def scaled_gemm(q: torch.Tensor, row_scale: torch.Tensor, weight_q: torch.Tensor, column_scale: torch.Tensor,
                bias: torch.Tensor | None, dtype: torch.dtype, config: GemmConfig = GemmConfig()) -> torch.Tensor:
    """q [R, K] and weight_q [N, K] float8_e4m3fn (rows contiguous), row_scale [R, 1] and column_scale [N] float32,
    bias [N] or None -> [R, N] in dtype: dtype(sum_k q[r, k] * weight_q[n, k] * row_scale[r] * column_scale[n]
    + bias[n]), the arithmetic of the tensor-wise GEMM into float32 followed by `rescale_rows_columns` (but for
    the precision of Hopper's FP8 accumulation: see above)."""
    rows, depth = q.shape
    cols = weight_q.shape[0]
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    if rows:
        block_m = min(max(MIN_BLOCK_M, triton.next_power_of_2(rows)), 128)
        grid = (triton.cdiv(cols, config.block_n), triton.cdiv(rows, block_m))
        _scaled_gemm_kernel[grid](
            q, weight_q, row_scale, column_scale, bias if bias is not None else column_scale, out, rows, cols, depth,
            q.stride(0), weight_q.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            EVEN_K=depth % config.block_k == 0, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            PROMOTE_EVERY=config.promote_every, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
