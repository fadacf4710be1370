"""Every declared architecture serves PEFT's own output: greedy tokens of the base and two adapters in one mixed
batch (prompts prefilled in chunks, windows passing mid-block) equal PeftModel.generate, and prompt logits agree
within 1e-4, in float32 on CPU, on tiny random models. A feature case first shows that its feature changes
PEFT's output, so the engine cannot pass by ignoring it. What is not declared is refused at start-up. An FP8 base
serves the same FP8 base under PEFT's adapter arithmetic on every architecture (float32 arithmetic on CPU, the
FP8 GEMMs on the GPU)."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engine import builder
from app.engine.engine import LLMEngine
from app.model import attention
from app.model.architectures import UnsupportedModel
from app.model.kernels.attention import attend, window_mask
from arch_helpers import CASES, build_case, case_config, peft_references, tiny_config
from engine_helpers import BF16_ATOL, agrees_up_to_near_tie, engine_config, greedy, run_all
from fp8_helpers import fp8_peft_model, fp8_peft_reference

MAX_NEW = 20
PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps", "Once upon a time"]
# The feature each case exists for, switched off: PEFT's logits must change by more than this.
FEATURE_OFF = {
    "llama-biases": dict(attention_bias=False),
    "mistral-window": dict(sliding_window=256),
    "qwen2-window": dict(sliding_window=256),
    "gemma2": dict(sliding_window=256, attn_logit_softcapping=None, final_logit_softcapping=None),
    "gemma3": dict(sliding_window=256, final_logit_softcapping=None),
    "phi3": dict(sliding_window=256),
}
MATTERS = 1e-2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, demo_dir):
    """The case's folders and PEFT's references: (adapter or None, prompt) -> (greedy tokens, prompt logits)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    info = build_case(root, name, Path(demo_dir) / "base")
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    references = peft_references(root, info["adapters"], PROMPTS, MAX_NEW)
    return {"name": name, "root": root, "references": references, "tokenizer": tokenizer, **info}


def serve(case, **overrides) -> LLMEngine:
    engine = LLMEngine(engine_config(case["root"], num_slots=4, **overrides))
    for adapter in case["adapters"]:
        engine.register_adapter(adapter, str(case["root"] / "adapters" / adapter))
    return engine


def test_the_case_exercises_its_feature_and_its_adapters(case):
    references = case["references"]
    assert references["all", PROMPTS[0]][0] != references[None, PROMPTS[0]][0]  # the adapter changes the tokens
    off = FEATURE_OFF.get(case["name"])
    if off is None:
        return
    config = case_config(case["name"])
    for field, value in off.items():
        setattr(config, field, value)
    model = AutoModelForCausalLM.from_pretrained(case["root"] / "base", config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**case["tokenizer"](PROMPTS[0], return_tensors="pt")).logits[0]
    assert (logits - references[None, PROMPTS[0]][1]).abs().max().item() > MATTERS


def test_greedy_tokens_equal_peft_generate_in_one_mixed_batch(case):
    engine = serve(case, max_prefill_tokens_per_step=8)  # prompts prefill in chunks: windows span chunks
    try:
        keys = {}
        for adapter, prompt in case["references"]:
            keys[engine.add_request(prompt, adapter, greedy(MAX_NEW)).request_id] = (adapter, prompt)
        tokens = run_all(engine, check=True)
    finally:
        engine.shutdown()
    for request_id, key in keys.items():
        assert tokens[request_id] == case["references"][key][0], key


def test_prompt_logits_within_1e_4(case):
    engine = serve(case)
    try:
        for (adapter, prompt), (_, expected) in case["references"].items():
            got = engine.prompt_logits(prompt, adapter)
            assert (got - expected).abs().max().item() <= 1e-4, (adapter, prompt)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", list(CASES))
def test_an_fp8_base_serves_its_fp8_arithmetic(tmp_path, demo_dir, monkeypatch, name):
    """`quantization: fp8` on every architecture's projections (Qwen2's q/k/v biases, Gemma's soft-capping, Phi-3's
    fused q/k/v and gate/up), in the engine's FP8 arithmetic run in float32 on CPU (`fp8_linear_reference`; the GEMMs
    themselves are the GPU tests'): prompt logits equal the same FP8 base under PEFT's adapter arithmetic within
    1e-4, for the base and two adapters, where the dense model's differ by more than 1e-3."""
    monkeypatch.setattr(builder, "check_fp8_device", lambda device: None)  # CPU has no FP8 GEMM, only the reference
    build_case(tmp_path, name, Path(demo_dir) / "base")
    engine = LLMEngine(engine_config(tmp_path, quantization="fp8"))
    try:
        assert engine.runner.model.model.layers[0].mlp.down_proj.base.weight_q.dtype == torch.float8_e4m3fn
        for adapter in ["all", "some"]:
            engine.register_adapter(adapter, str(tmp_path / "adapters" / adapter))
        ids = AutoTokenizer.from_pretrained(tmp_path / "base")(PROMPTS[0], return_tensors="pt")
        dense = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        for adapter in [None, "all", "some"]:
            with torch.no_grad():
                want = fp8_peft_model(tmp_path, adapter, device="cpu", dtype=torch.float32)(**ids).logits[0]
            got = engine.prompt_logits(PROMPTS[0], adapter)
            assert (got - want).abs().max().item() <= 1e-4, adapter
        with torch.no_grad():
            off = (dense(**ids).logits[0] - engine.prompt_logits(PROMPTS[0])).abs().max().item()
        assert off > 1e-3, f"FP8 moved the base's logits by only {off}: the case cannot tell FP8 from dense"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model_type, overrides, phrase", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "mixture-of-experts"),
    ("qwen2_moe", {}, "mixture-of-experts"),
    ("gpt2", {}, "no architecture is declared"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
])
def test_engine_refuses_at_start_up_before_the_weights_load(tmp_path, demo_dir, model_type, overrides, phrase):
    base = tmp_path / "base"
    tiny_config(model_type, **overrides).save_pretrained(base)  # no weights: the check must come first
    (tmp_path / "adapters").mkdir()
    with pytest.raises(UnsupportedModel, match=phrase) as refused:
        LLMEngine(engine_config(tmp_path))
    assert repr(model_type) in str(refused.value) and "llama" in str(refused.value)


def test_a_declaration_transformers_disagrees_with_fails_loudly(tmp_path, demo_dir):
    """The paged attention applies the declared window and cap, and checks them against what transformers'
    module asks for, so a wrong declaration stops the forward instead of serving other attention."""
    build_case(tmp_path, "mistral-window", Path(demo_dir) / "base")
    engine = LLMEngine(engine_config(tmp_path, num_slots=2))
    try:
        engine.runner.model.model.layers[1].self_attn.paged_window = 6
        with pytest.raises(RuntimeError, match=r"layer 1: transformers asks for sliding_window=5.*declares 6"):
            engine.prompt_logits(PROMPTS[0], None)
    finally:
        engine.shutdown()


def packed_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
    """varlen flash's contract with its window, per sequence: causal, bottom-right aligned, GQA."""
    out, cu_q, cu_k = torch.empty_like(q), cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        mask = window_mask(len(ks), len(qs), window, q.device)
        out[cu_q[i]:cu_q[i + 1]] = attend(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), scale,
                                          mask).transpose(0, 1)
    return out


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_packed_varlen_prefill_passes_each_layers_window(tmp_path, demo_dir, monkeypatch, name):
    """The runner's one-call-per-layer prefill (CUDA's varlen flash; its contract stands in on CPU) with each
    layer's window, prompts in chunks: PEFT's tokens."""
    case = {"root": tmp_path, **build_case(tmp_path, name, Path(demo_dir) / "base")}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    windows = []
    monkeypatch.setattr(attention, "VARLEN", lambda *args: windows.append(args[8:]) or packed_reference(*args))
    engine = serve(case, max_prefill_tokens_per_step=8)
    engine.runner.use_varlen = True
    try:
        for prompt in PROMPTS:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                expected = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
            request = engine.add_request(prompt, None, greedy(MAX_NEW))
            assert run_all(engine)[request.request_id] == expected[0, inputs["input_ids"].shape[1]:].tolist()
    finally:
        engine.shutdown()
    assert set(windows) == {(w,) if w else () for w in case["arch"].windows(case["config"])}


def bf16_reference(root, adapter, prompt):
    """PEFT's greedy tokens, their scores and the prompt logits in bf16 on CUDA, through transformers' eager
    attention: its SDPA path dropped Gemma 2's score soft-capping in some releases."""
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, root / "adapters" / adapter)
    model = model.cuda().eval()
    inputs = AutoTokenizer.from_pretrained(root / "base")(prompt, return_tensors="pt").to("cuda")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, output_scores=True,
                             return_dict_in_generate=True)
        logits = model(**inputs).logits[0].float().cpu()
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [s[0].float().cpu() for s in out.scores], logits


# (case, head_dim, compile_decode): Gemma 2 also at its real head size, decoded as the benches run it (compiled)
GPU_CASES = [(name, 64, False) for name in ["llama", "mistral-window", "qwen2-window", "qwen3", "gemma2", "gemma3",
                                            "phi3"]] + [("gemma2", 256, True)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, head_dim, compiled", GPU_CASES)
@pytest.mark.parametrize("max_graph_tokens", [512, 0])  # 0: prefill runs eagerly (varlen flash, or SDPA)
def test_bf16_on_cuda_agrees_with_peft(tmp_path, demo_dir, name, head_dim, compiled, max_graph_tokens):
    """head_dim 64 or 256, so decode runs the Triton kernel (with the layer's window and cap) in CUDA graphs."""
    build_case(tmp_path, name, Path(demo_dir) / "base", head_dim=head_dim)
    engine = LLMEngine(engine_config(tmp_path, device="cuda", dtype="bfloat16", num_slots=4, max_batch_size=8,
                                     compile_decode=compiled, max_graph_tokens=max_graph_tokens))
    try:
        assert engine.runner.use_kernel and engine.runner.graphs
        for adapter in ["all", "some"]:
            engine.register_adapter(adapter, str(tmp_path / "adapters" / adapter))
        references, requests = {}, {}
        for adapter in [None, "all", "some"]:
            for prompt in PROMPTS:
                references[adapter, prompt] = bf16_reference(tmp_path, adapter, prompt)
                requests[engine.add_request(prompt, adapter, greedy(MAX_NEW)).request_id] = (adapter, prompt)
        tokens = run_all(engine, check=True)
        for request_id, (adapter, prompt) in requests.items():
            expected, scores, logits = references[adapter, prompt]
            assert agrees_up_to_near_tie(tokens[request_id], expected, scores), (adapter, prompt)
            error = (engine.prompt_logits(prompt, adapter) - logits).abs().max().item()
            assert error <= BF16_ATOL, (adapter, prompt, error)
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU")
@pytest.mark.parametrize("name", ["llama-biases", "qwen2-window", "gemma2", "gemma3", "phi3"])
def test_fp8_on_cuda_serves_the_fp8_arithmetic(tmp_path, demo_dir, name):
    """An FP8 base on each kind of projection (biases, soft-capping, windows, Phi-3's fused ones), served as the engine
    serves by default (compiled decoder, quantization fused into its kernels, CUDA graphs, chunked prefill): greedy
    tokens of the base and two adapters equal the same FP8 base under PEFT's adapter arithmetic up to a near tie."""
    build_case(tmp_path, name, Path(demo_dir) / "base", head_dim=64)
    engine = LLMEngine(engine_config(tmp_path, device="cuda", dtype="bfloat16", quantization="fp8", num_slots=4,
                                     max_batch_size=8, max_prefill_tokens_per_step=16))
    try:
        assert engine.runner.graphs and engine.runner.compiled
        for adapter in ["all", "some"]:
            engine.register_adapter(adapter, str(tmp_path / "adapters" / adapter))
        requests = {}
        for adapter in [None, "all", "some"]:
            for prompt in PROMPTS:
                requests[engine.add_request(prompt, adapter, greedy(MAX_NEW)).request_id] = (adapter, prompt)
        tokens = run_all(engine, check=True)
        for request_id, (adapter, prompt) in requests.items():
            expected, scores = fp8_peft_reference(tmp_path, adapter, prompt, MAX_NEW)
            assert agrees_up_to_near_tie(tokens[request_id], expected, scores), (adapter, prompt)
    finally:
        engine.shutdown()
