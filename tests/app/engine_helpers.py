"""Helpers shared by the engine tests.

bf16 tolerance (the CUDA tests): greedy tokens may part from PEFT's only where PEFT's own top-2 logits are
within BF16_TIE of each other (a near tie that bf16 rounding can flip); prompt logits agree within BF16_ATOL.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engine.config import EngineConfig
from app.sampling.params import SamplingParams


# The tiny demo's adapters take kilobytes: a small arena keeps each test process's reserved memory small, so that
# processes it forks (servers, engine children) are not refused under the kernel's overcommit check.
TEST_HOST_CACHE_BYTES = 64 << 20


def engine_config(demo_dir, **overrides) -> EngineConfig:
    fields = dict(base_model=str(Path(demo_dir) / "base"), adapter_roots=(str(Path(demo_dir) / "adapters"),),
                  num_slots=4, max_rank=16, device="cpu", dtype="float32", host_cache_bytes=TEST_HOST_CACHE_BYTES)
    fields.update(overrides)
    return EngineConfig(**fields)


def run_all(engine, check=False, on_step=None) -> dict[str, list[int]]:
    """Step until idle; returns request_id -> generated token ids."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if check:
            engine.check_invariants()
        if on_step:
            on_step(engine)
    return tokens


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def tokens_alone(engine, prompt, adapters, max_tokens=12) -> dict:
    """adapter -> greedy tokens of `prompt` run alone on a synchronous engine (the streaming tests' reference)."""
    expected = {}
    for adapter in adapters:
        request = engine.add_request(prompt, adapter, greedy(max_tokens))
        expected[adapter] = run_all(engine)[request.request_id]
    return expected


def jobs(manifest, adapter_names, n=10):
    """n (prompt, adapter) pairs of varied lengths over the demo's adapters and the base."""
    prompts = manifest["prompts"]
    return [(prompts[i % len(prompts)] * (1 + i % 3), (adapter_names + [None])[i % (len(adapter_names) + 1)])
            for i in range(n)]


def packed_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """varlen flash's contract, per sequence: causal, bottom-right aligned, GQA."""
    out, group = torch.empty_like(q), q.shape[1] // k.shape[1]
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        n, length = len(qs), len(ks)
        assert n <= max_q and length <= max_k
        keys = torch.arange(length)
        mask = keys[None, :] <= keys[length - n:, None]
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1).repeat_interleave(group, 0),
                                           vs.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask, scale=scale)
        out[cu_q[i]:cu_q[i + 1]] = o.transpose(0, 1)
    return out


BF16_TIE = 0.25
BF16_ATOL = 0.15


def bf16_reference(demo_dir, adapter_path, prompt, max_new=16):
    """PEFT's greedy tokens, their scores and the prompt logits in bf16 on CUDA."""
    tokenizer = AutoTokenizer.from_pretrained(Path(demo_dir) / "base")
    model = AutoModelForCausalLM.from_pretrained(Path(demo_dir) / "base", dtype=torch.bfloat16).cuda()
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, Path(demo_dir) / adapter_path)
    inputs = tokenizer(prompt, return_tensors="pt").to("cuda")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, output_scores=True,
                             return_dict_in_generate=True)
        logits = model(**inputs).logits[0].float().cpu()
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [s[0].float().cpu() for s in out.scores], logits


def agrees_up_to_near_tie(got, expected, scores):
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            top2 = scores[i].topk(2).values
            return (top2[0] - top2[1]).item() <= BF16_TIE
    return len(got) == len(expected) or got[: len(expected)] == expected


def assert_bf16_fidelity(engine, model_dir, prompt: str, adapters: dict[str, str], max_new=16) -> None:
    """The engine's greedy tokens of `prompt` equal PEFT's in bf16 up to near ties, and its prompt logits agree
    within BF16_ATOL, for the base and every adapter (name -> its folder, relative to model_dir)."""
    for name, path in [(None, None), *adapters.items()]:
        tokens, scores, logits = bf16_reference(model_dir, path, prompt, max_new)
        request = engine.add_request(prompt, name, greedy(max_new))
        got = run_all(engine, check=True)[request.request_id]
        assert agrees_up_to_near_tie(got, tokens, scores), (name, got, tokens)
        assert (engine.prompt_logits(prompt, name) - logits).abs().max().item() <= BF16_ATOL, name
