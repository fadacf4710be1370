"""FP8 base weights (app/model/fp8.py) on CPU: the quantizer and its scales, the linear's arithmetic against the
dense one it stands for, and the refusal of `quantization: fp8` where there is no FP8 GEMM. The GEMMs themselves
are tested on the device (tests/app/model/test_fp8_gpu.py)."""

import pytest
import torch
from torch import nn

from app.engine.config import EngineConfig
from app.model.fp8 import (FP8, FP8_MAX, Fp8Linear, Fp8Unsupported, Fp8Weight, check_fp8_device, fp8_linear,
                           fp8_linear_reference, quantize_linears, quantize_rows)


def test_each_row_maps_its_largest_magnitude_to_fp8s_largest_value():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 1e3, 0.0])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(dim=1)
    torch.testing.assert_close(scale[:5, 0], amax[:5] / FP8_MAX)
    assert torch.equal(q.float().abs().amax(dim=1)[:5], torch.full((5,), FP8_MAX))
    assert not q[5].float().any() and scale[5] > 0  # a row of zeros stays zeros
    # e4m3 keeps 3 mantissa bits: each element within half a step (1/16 relative) of its value, or tiny
    error = (q.float() * scale - x).abs()
    assert bool((error <= x.abs() / 16 + scale * 2.0 ** -9).all())


def test_a_weight_quantizes_per_output_channel_and_halves_bf16s_bytes():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    fp8 = Fp8Weight.quantize(weight)
    assert fp8.shape == (48, 32) and fp8.scale.shape == (48,)
    assert fp8.nbytes() == 48 * 32 + 48 * 4  # against 48 * 32 * 2 in bf16
    torch.testing.assert_close(fp8.dequantize(), weight, rtol=1 / 16, atol=1e-6)
    parts = fp8.split([16, 32])
    joined = Fp8Weight.cat(parts)
    assert torch.equal(joined.q.view(torch.uint8), fp8.q.view(torch.uint8)) and torch.equal(joined.scale, fp8.scale)


def test_the_linear_is_the_dense_arithmetic_of_its_quantized_operands():
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(32, 24, bias=True)
    x = torch.randn(2, 5, 32, generator=gen)
    fp8 = Fp8Linear.from_linear(linear)
    xq, xs = quantize_rows(x.reshape(-1, 32))
    expected = (xq.float() * xs) @ (fp8.weight_q.float() * fp8.weight_scale[:, None]).T + linear.bias
    with torch.no_grad():
        got = fp8(x)
        torch.testing.assert_close(got, expected.view(2, 5, 24))
        torch.testing.assert_close(fp8_linear(x, fp8.fp8, fp8.bias), fp8_linear_reference(x, fp8.fp8, fp8.bias))
        # and near the bf16-free dense linear: quantization error of a few percent of the output's scale
        dense = linear(x)
        assert (got - dense).abs().max() < 0.05 * dense.abs().max()


def test_only_the_named_projections_are_quantized():
    model = nn.Sequential()
    model.add_module("block", nn.Module())
    model.block.q_proj, model.block.norm = nn.Linear(8, 8), nn.LayerNorm(8)
    model.add_module("lm_head", nn.Linear(8, 4))
    assert quantize_linears(model, ["block.q_proj"]) == 1
    assert type(model.block.q_proj) is Fp8Linear and type(model.lm_head) is nn.Linear
    with pytest.raises(TypeError, match="block.norm is LayerNorm"):
        quantize_linears(model, ["block.norm"])


def test_fp8_is_refused_where_there_is_no_fp8_gemm(demo_dir):
    from app.engine.engine import LLMEngine

    with pytest.raises(Fp8Unsupported, match="FP8 tensor cores.*device is cpu"):
        check_fp8_device(torch.device("cpu"))
    config = EngineConfig(base_model=str(demo_dir / "base"), device="cpu", quantization="fp8")
    with pytest.raises(Fp8Unsupported, match="quantization: fp8 needs a CUDA GPU"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(base_model="m", quantization="int4")
