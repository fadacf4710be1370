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
"""

from __future__ import annotations

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
