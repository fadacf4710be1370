"""Logprobs of generated and prompt tokens (echo) against PEFT's own log-softmax, float32 within 1e-4."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from app.sampling.params import SamplingParams
from engine_helpers import jobs, run_all

TOL = 1e-4


@pytest.fixture(scope="module")
def peft_model(demo_dir, manifest):
    adapter = manifest["adapters"][1]
    model = AutoModelForCausalLM.from_pretrained(Path(demo_dir) / "base", dtype=torch.float32)
    return adapter["name"], PeftModel.from_pretrained(model, Path(demo_dir) / adapter["path"]).eval()


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: PEFT's log-softmax at every position."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def collect(engine) -> dict:
    """request_id -> (tokens, logprobs, prompt_logprobs, finish_reason)."""
    out = {}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            tokens, lps, prompt, _ = out.get(o.request_id, ([], [], None, None))
            out[o.request_id] = (tokens + list(o.token_ids), lps + list(o.logprobs), prompt or o.prompt_logprobs,
                                 o.finish_reason)
    return out


def assert_entry(entry, expected: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - expected[token].item()) <= TOL
    assert len(entry.top) == k
    values = expected.topk(k).values.tolist()
    for (t, lp), want in zip(entry.top, values):
        assert abs(lp - want) <= TOL and abs(expected[t].item() - lp) <= TOL


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_generated_logprobs_equal_peft_log_softmax_of_raw_logits(make_engine, peft_model, manifest, temperature):
    adapter, model = peft_model
    engine = make_engine()
    prompt = manifest["prompts"][0]
    # Penalties and temperature change the choice, never the reported values (raw logits, as vLLM).
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=3, logprobs=5, repetition_penalty=1.5,
                            logit_bias=((7, 4.0),))
    request = engine.add_request(prompt, adapter, params)
    plain = engine.add_request(prompt, adapter, SamplingParams(max_tokens=10, temperature=0.0))
    results = collect(engine)
    tokens, logprobs, prompt_logprobs, _ = results[request.request_id]
    assert len(logprobs) == len(tokens) == 10 and prompt_logprobs is None
    assert results[plain.request_id][1] == []  # a request that did not ask gets none
    expected = log_softmax(model, request.prompt_ids + tokens)[len(request.prompt_ids) - 1:]
    for i, (entry, token) in enumerate(zip(logprobs, tokens)):
        assert_entry(entry, expected[i], token, 5)


def test_logprobs_zero_gives_the_sampled_token_alone(make_engine):
    engine = make_engine(register=False)
    request = engine.add_request("hello there", None, SamplingParams(max_tokens=3, temperature=0, logprobs=0))
    _, logprobs, _, _ = collect(engine)[request.request_id]
    assert len(logprobs) == 3 and all(e.top == () and e.logprob <= 0 for e in logprobs)


@pytest.mark.parametrize("max_tokens", [0, 1, 5])
@pytest.mark.parametrize("chunk", [2048, 5])
def test_echo_prompt_logprobs_equal_peft(make_engine, peft_model, manifest, max_tokens, chunk):
    adapter, model = peft_model
    engine = make_engine(max_prefill_tokens_per_step=chunk)
    extra_rows = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan, **kw: (extra_rows.append(list(kw.get("extra_rows", ()))),
                                                execute(plan, **kw))[1]
    prompt = " ".join(manifest["prompts"])
    echo = engine.add_request(prompt, adapter, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2,
                                                              prompt_logprobs=3))
    other = engine.add_request(prompt, adapter, SamplingParams(max_tokens=3, temperature=0, logprobs=1))
    results = collect(engine)
    tokens, _, prompt_logprobs, finish = results[echo.request_id]
    ids = echo.prompt_ids
    assert len(tokens) == max_tokens and (max_tokens > 0 or finish == "length")
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0].logprob is None
    assert [e.token_id for e in prompt_logprobs] == ids
    expected = log_softmax(model, ids)
    for p, entry in enumerate(prompt_logprobs[1:]):
        assert_entry(entry, expected[p], ids[p + 1], 3)
    assert results[other.request_id][2] is None
    # The prompt's logits were computed once per position, and only for the request that asked.
    assert sum(map(len, extra_rows)) == len(ids) - 1
    if chunk < len(ids):
        assert sum(1 for rows in extra_rows if rows) > 1, "the prompt was not chunked"


def test_echo_prompt_logprobs_survive_preemption(make_engine, manifest, adapter_names):
    work = jobs(manifest, adapter_names, 8)

    def run(engine):
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        requests = [engine.add_request(p, a, params) for p, a in work]
        results = collect(engine)
        return [results[r.request_id] for r in requests]

    roomy = run(make_engine(num_slots=8))
    tight_engine = make_engine(num_slots=8, max_total_tokens=192, max_input_tokens=128)
    tight = run(tight_engine)
    assert tight_engine.metrics()["preemptions"] > 0, "the cache never ran out"
    for (tokens_a, lps_a, prompt_a, _), (tokens_b, lps_b, prompt_b, _) in zip(roomy, tight):
        assert tokens_a == tokens_b and len(prompt_a) == len(prompt_b)
        for a, b in zip(prompt_a[1:] + tuple(lps_a), prompt_b[1:] + tuple(lps_b)):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL


def test_seeded_sampling_is_unchanged_by_asking_for_logprobs(make_engine):
    engine = make_engine(register=False)
    base = dict(max_tokens=12, temperature=1.0, seed=42)
    a = engine.add_request("once upon", None, SamplingParams(**base))
    b = engine.add_request("once upon", None, SamplingParams(**base, logprobs=4))
    tokens = run_all(engine)
    assert tokens[a.request_id] == tokens[b.request_id]
