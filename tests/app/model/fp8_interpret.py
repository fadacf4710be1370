"""Runs `scaled_gemm` in Triton's CPU interpreter against the float32 arithmetic it stands for (launched by
test_fp8.py in a process with TRITON_INTERPRET=1): ragged rows, columns and depths, with and without a bias, and
several tilings. float16 and float32 outputs: the interpreter computes bfloat16 wrong."""

import torch

import lora_interpret  # noqa: F401  (patches the interpreter for NumPy >= 2.4)
from app.model.fp8 import Fp8Weight, quantize_rows
from app.model.kernels.fp8 import GemmConfig, scaled_gemm

CASES = [
    # (rows, depth, columns, bias, output dtype, config)
    (1, 256, 96, True, torch.float32, GemmConfig()),
    (7, 200, 64, False, torch.float32, GemmConfig(block_n=16, block_k=64)),  # depth not a multiple of block_k
    (33, 384, 150, True, torch.float16, GemmConfig(block_n=64, block_k=128)),  # 150 columns: a ragged last tile
    (130, 128, 40, True, torch.float32, GemmConfig(block_n=32, block_k=32)),  # two programs of 128 rows
    (5, 512, 64, True, torch.float32, GemmConfig(block_n=32, block_k=128, promote_every=64)),
    (0, 64, 32, False, torch.float32, GemmConfig()),
]


def main() -> None:
    for i, (rows, depth, columns, with_bias, dtype, config) in enumerate(CASES):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(rows, depth, generator=gen) * torch.logspace(-2, 2, max(rows, 1))[:rows, None]
        weight = Fp8Weight.quantize(torch.randn(columns, depth, generator=gen) * 0.05)
        bias = torch.randn(columns, generator=gen) if with_bias else None
        q, scale = quantize_rows(x)
        got = scaled_gemm(q, scale, weight.q, weight.scale, bias, dtype, config)
        expected = (q.float() @ weight.q.float().t()) * scale * weight.scale[None, :]
        if bias is not None:
            expected = expected + bias
        assert got.shape == (rows, columns) and got.dtype == dtype
        error = ((got.float() - expected).abs() / (expected.abs() + 1e-3)).max().item() if rows else 0.0
        assert error <= (1e-3 if dtype == torch.float16 else 1e-5), f"case {i}: max relative error {error}"
        print(f"case {i} ok ({error:.1e})")
    print("all interpreter cases match")


if __name__ == "__main__":
    main()
