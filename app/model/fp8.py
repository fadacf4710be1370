"""FP8 base weights: the base model's linear projections in float8_e4m3fn with one scale per output channel, and
activations quantized per token as each step runs. Adapters stay in the model's dtype and add their output to the
FP8 GEMM's (app/model/lora.py), so adapter files, residency and hints do not change.

The GEMM is cuBLASLt's through `torch._scaled_mm`, with row-wise scales: the activation's scale per row of x and
the weight's per column of the output. `fp8_linear_reference` does the same arithmetic in float32 (dequantized
operands, the same activation quantization): the tests hold the GEMM to it, and it is the only path on CPU, which
has no FP8 GEMM; the engine refuses `quantization: fp8` there (app/engine/builder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.model.kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_rows_fused, rescale_rows_columns, triton

# Up to this many rows (tokens), fp8_linear runs the tensor-wise GEMM and rescales its float32 output; above, the
# row-wise GEMM (bench/kernel/fp8.py times both).
SMALL_BATCH_ROWS = 128


class Fp8Unsupported(ValueError):
    """`quantization: fp8` on a device without an FP8 GEMM."""


def check_fp8_device(device: torch.device) -> None:
    """Refuses a device where `fp8_linear` has no GEMM: CPU, and GPUs before compute capability 8.9 (Ada, Hopper)."""
    if device.type != "cuda":
        raise Fp8Unsupported(f"quantization: fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or "
                             f"more); the engine's device is {device.type}, which has no FP8 GEMM. Serve the base "
                             "in its own dtype there (quantization: null).")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise Fp8Unsupported(f"quantization: fp8 needs FP8 tensor cores (compute capability 8.9 or more); "
                             f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8_e4m3fn [R, C], float32 scales [R, 1]) with x ≈ q * scale: each row's largest magnitude
    maps to FP8's largest finite value (448), rounded to nearest."""
    rows = x.float()
    # times float32(1 / 448) rather than divided by 448, as the fused kernel computes it (bit for bit)
    scale = (rows.abs().amax(dim=-1, keepdim=True) * (1 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's weight as FP8: q [out, in] float8_e4m3fn, scale [out] float32 (one per output channel)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(weight.detach())
        return cls(q, scale.flatten())

    @classmethod
    def cat(cls, weights: list[Fp8Weight]) -> Fp8Weight:
        """Siblings that read the same input, as one weight (their outputs side by side)."""
        return cls(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))

    def split(self, widths: list[int]) -> list[Fp8Weight]:
        return [Fp8Weight(q, s) for q, s in zip(self.q.split(widths), self.scale.split(widths))]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


Quantized = tuple[torch.Tensor, torch.Tensor]  # quantize_rows(x.reshape(-1, in_features)), computed by the caller


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               quantized: Quantized | None = None) -> torch.Tensor:
    """x @ W.T + bias in x's dtype, with x quantized per token and W per output channel: one cuBLASLt FP8 GEMM.
    `quantized`: x's rows already quantized (the compiled decoder quantizes them in the kernel that computes x)."""
    if x.device.type != "cuda":
        return fp8_linear_reference(x, weight, bias, quantized)
    x2 = x.reshape(-1, x.shape[-1])
    if quantized is not None:
        q, scale = quantized
    else:
        q, scale = quantize_rows(x2) if triton is None else quantize_rows_fused(x2)
    if triton is not None and x2.shape[0] <= SMALL_BATCH_ROWS:
        # Unit scales: the GEMM sums q_x * q_w in float32, rescale_rows_columns applies both scales and the bias.
        unit = _unit_scale(x.device)
        acc = torch._scaled_mm(q, weight.q.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
        return rescale_rows_columns(acc, scale, weight.scale, bias, x.dtype).view(*x.shape[:-1], -1)
    # Row-wise scales: scale_a [T, 1] per token, scale_b [1, out] per output channel; weight.q.t() is the
    # column-major operand cuBLASLt wants. The bias is added apart: not every build takes one with row-wise scales.
    y = torch._scaled_mm(q, weight.q.t(), scale_a=scale, scale_b=weight.scale[None, :], out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.q.shape[0])


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1 on the device, made once (CUDA graphs capture its address)."""
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                         quantized: Quantized | None = None) -> torch.Tensor:
    """fp8_linear's arithmetic in float32: the quantized activation and weight, dequantized, multiplied."""
    q, scale = quantized if quantized is not None else quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (q.float() * scale) @ weight.dequantize().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.q.shape[0])


def base_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
                quantized: Quantized | None = None) -> torch.Tensor:
    """The base GEMM of a linear, whichever form its weight has (`quantized`: an FP8 weight's input, quantized)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias, quantized)
    return nn.functional.linear(x, weight, bias)


class Fp8Linear(nn.Module):
    """nn.Linear's place in the model with its weight in FP8 (`fp8`); the bias stays in the model's dtype."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_q", weight.q)
        self.register_buffer("weight_scale", weight.scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(Fp8Weight.quantize(linear.weight), linear.bias)

    @property
    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight_q, self.weight_scale)

    def set_fp8(self, weight: Fp8Weight) -> None:
        self.weight_q, self.weight_scale = weight.q, weight.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(model: nn.Module, paths) -> int:
    """Replace the nn.Linear at each module path (the architecture's projections, every layer) with an Fp8Linear;
    returns how many. A tensor-parallel shard's row-parallel projections become their FP8 form (`to_fp8`).
    Embeddings, norms and lm_head keep the model's dtype."""
    count = 0
    for path in paths:
        linear = model.get_submodule(path)
        to_fp8 = getattr(linear, "to_fp8", None)
        if type(linear) is not nn.Linear and to_fp8 is None:
            raise TypeError(f"{path} is {type(linear).__name__}, not torch.nn.Linear: it cannot be quantized to FP8")
        model.set_submodule(path, Fp8Linear.from_linear(linear) if to_fp8 is None else to_fp8())
        count += 1
    return count
