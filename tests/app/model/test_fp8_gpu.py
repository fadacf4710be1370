"""FP8 base weights on the device (marker `gpu`; compute capability 8.9 or more): cuBLASLt's FP8 GEMM (eagerly and
replayed in a CUDA graph) equals the float32 arithmetic it stands for, and an engine over an FP8 base serves the
greedy tokens of the same FP8 base under PEFT's adapter arithmetic, for the base and three adapters in mixed
batches, graphs on."""

import pytest
import torch
from torch import nn

from app.model.fp8 import Fp8Weight, fp8_linear, fp8_linear_reference, quantize_rows
from app.model.kernels.fp8 import quantize_rows_fused
from engine_helpers import agrees_up_to_near_tie, greedy, run_all
from fp8_helpers import fp8_peft_reference, write_fp8_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU")]
MAX_NEW = 12


def operands(m: int, n_in: int = 256, n_out: int = 512):
    gen = torch.Generator(device="cuda").manual_seed(m)
    linear = nn.Linear(n_in, n_out, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, Fp8Weight.quantize(linear.weight), linear.bias.detach()


@pytest.mark.parametrize("m", [1, 7, 32, 129, 512])
def test_the_fp8_gemm_equals_its_float32_arithmetic(m):
    x, weight, bias = operands(m)
    got = fp8_linear(x, weight, bias)
    expected = fp8_linear_reference(x.float(), weight, bias).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 512)
    torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-2)  # bf16's rounding of the same sums


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(0, 64), (1, 4096), (33, 5000), (130, 14336)])
def test_the_fused_quantization_equals_quantize_rows_bit_for_bit(dtype, rows, cols):
    gen = torch.Generator(device="cuda").manual_seed(rows * cols)
    magnitudes = torch.logspace(-6, 4, max(rows, 1), device="cuda")[:rows, None]  # tiny rows to huge ones
    x = (torch.randn(rows, cols + 8, device="cuda", generator=gen) * magnitudes).to(dtype)[:, 4:cols + 4]
    if rows > 2:
        x[1] = 0  # a row of zeros quantizes to zeros under MIN_SCALE
    q, scale = quantize_rows_fused(x)
    expected_q, expected_scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, cols) and scale.shape == (rows, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


def test_the_fp8_gemm_replays_in_a_cuda_graph():
    x, weight, bias = operands(32)
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(static, weight, bias)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(static, weight, bias)
    new = operands(32)[0] * 3
    static.copy_(new)
    graph.replay()
    expected = fp8_linear_reference(new.float(), weight, bias).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=3e-2)


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled-graphs"])
def test_an_fp8_engine_serves_the_fp8_base_and_its_adapters_as_peft_computes_them(make_engine, graph_model,
                                                                                      manifest, compiled):
    """compiled: the decoder under torch.compile, which quantizes each projection's input in the kernel that
    computes it (inductor's division rounds within 2 ulp, so a rare element may quantize one FP8 step apart)."""
    names = ["a0", "a1", "a2"]
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)], ([None] + names)[i % 4]) for i in range(8)]
    engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                         quantization="fp8", adapter_roots=(str(graph_model / "adapters"),), num_slots=4,
                         compile_decode=compiled, max_prefill_tokens_per_step=16)
    assert engine.runner.graphs
    for name in names:
        engine.register_adapter(name, str(graph_model / "adapters" / name))
    requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
    tokens = run_all(engine, check=True)
    for (prompt, adapter), request in zip(jobs, requests):
        got = tokens[request.request_id]
        expected, scores = fp8_peft_reference(graph_model, adapter, prompt, MAX_NEW)
        assert agrees_up_to_near_tie(got, expected, scores), (adapter, got, expected)


def test_an_fp8_checkpoint_serves_as_its_dense_model_quantized_here(make_engine, graph_model, manifest, tmp_path):
    """A compressed-tensors FP8 checkpoint of graph_model's base, served as it is, gives the tokens of the same
    base quantized at load (up to a near tie: the checkpoint's scales come from the float32 weights, the engine's
    from their bf16 copy)."""
    pytest.importorskip("compressed_tensors")

    checkpoint = write_fp8_checkpoint(graph_model / "base", tmp_path / "fp8")
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)], (None, "a2")[i % 2]) for i in range(4)]
    engine = make_engine(register=False, base_model=str(checkpoint), device="cuda", dtype="bfloat16",
                         adapter_roots=(str(graph_model / "adapters"),), num_slots=4, compile_decode=False)
    engine.register_adapter("a2", str(graph_model / "adapters" / "a2"))
    requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
    tokens = run_all(engine, check=True)
    for (prompt, adapter), request in zip(jobs, requests):
        expected, scores = fp8_peft_reference(graph_model, adapter, prompt, MAX_NEW)
        assert agrees_up_to_near_tie(tokens[request.request_id], expected, scores), (adapter, prompt)
