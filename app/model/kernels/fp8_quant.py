"""Per-token FP8 quantization of activations in one Triton kernel, the input side of `fp8_linear`
(app/model/fp8.py). It computes exactly what `quantize_rows` does in plain torch:

    for r in rows:
        scale[r] = max(max(abs(x[r])) / 448, MIN_SCALE)              # float32
        q[r] = round_to_nearest_even(clamp(x[r] / scale[r], -448, 448))  # float8_e4m3fn

Plain torch spends seven kernels on it (a float32 copy of x, abs, amax, two divisions, two clamps and the cast),
each a pass over memory; at decode batch sizes that is seven launches' latency per linear group and layer. Here
each program owns one row: a first pass over it finds the largest magnitude, a second (which reads it back from
L2) scales, clamps and casts. Divisions are IEEE round-to-nearest, as torch's, so q and scale equal
`quantize_rows`'s bit for bit. Written by hand: torch has no fused per-token FP8 quantization, and running
`quantize_rows` through torch.compile would put a guard check on every eager step's every linear.
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
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            v = tl.load(x_row + start + offs, mask=start + offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(libdevice.div_rn(tl.max(amax, axis=0), FP8_LIMIT), SCALE_MIN)
        tl.store(scale_ptr + row, scale)
        q_row = q_ptr + row * stride_q
        for start in range(0, cols, BLOCK):
            mask = start + offs < cols
            v = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(libdevice.div_rn(v, scale), -FP8_LIMIT, FP8_LIMIT)
            tl.store(q_row + start + offs, q.to(tl.float8e4nv), mask=mask)


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
