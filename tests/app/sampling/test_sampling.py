"""Sampling parameters and stop strings (the batched sampler: test_sampler.py)."""

import pytest

from app.errors import InvalidRequest
from app.sampling.params import SamplingParams, StopChecker
from engine_helpers import run_all


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", 3.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -1), ("max_tokens", -1)])
def test_out_of_range_parameters_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value})


def test_stop_list_limits():
    with pytest.raises(InvalidRequest, match="at most 8"):
        SamplingParams(stop=tuple("abcdefghi"))


def test_stop_checker_holds_back_possible_prefix():
    checker = StopChecker(("END",))
    assert checker.find("abc EN", 0) is None and checker.safe_end("abc EN") == 4
    assert checker.find("abc END more", 0) == 4


def test_stop_strings_truncate_engine_output(make_engine, manifest, adapter_names):
    engine = make_engine()
    prompt = manifest["prompts"][0]
    full = engine.add_request(prompt, adapter_names[0], SamplingParams(max_tokens=24, temperature=0))
    tokens = run_all(engine)[full.request_id]
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    engine.add_request(prompt, adapter_names[0], SamplingParams(max_tokens=24, temperature=0, stop=(stop,)))
    streamed, last = "", None
    while engine.has_work():
        for output in engine.step():
            streamed += output.text
            last = output
    assert last.finish_reason == "stop"
    assert streamed == text[: text.index(stop)]


def generate(engine, prompt, adapter, params):
    engine.add_request(prompt, adapter, params)
    text, tokens, last = "", [], None
    while engine.has_work():
        for output in engine.step():
            text, tokens, last = text + output.text, tokens + list(output.token_ids), output
    return text, tokens, last.finish_reason


def test_stop_token_ids_end_the_output_and_their_text_is_shown_only_when_asked(make_engine, manifest, adapter_names):
    engine = make_engine()
    prompt, adapter = manifest["prompts"][0], adapter_names[0]
    _, full, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=12, temperature=0))
    stop_id = full[3]
    assert stop_id not in full[:3]
    text, tokens, reason = generate(engine, prompt, adapter, SamplingParams(max_tokens=12, temperature=0,
                                                                            stop_token_ids=(stop_id,)))
    assert tokens == full[:4] and reason == "stop"
    assert text == engine.tokenizer.decode(full[:3], skip_special_tokens=True)
    shown, _, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=12, temperature=0,
                                                                   stop_token_ids=(stop_id,),
                                                                   include_stop_str_in_output=True))
    assert shown == engine.tokenizer.decode(full[:4], skip_special_tokens=True)


def test_include_stop_str_in_output_keeps_the_stop_string(make_engine, manifest, adapter_names):
    engine = make_engine()
    prompt, adapter = manifest["prompts"][0], adapter_names[0]
    full, _, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=24, temperature=0))
    stop = full[len(full) // 2: len(full) // 2 + 2]
    kept, _, reason = generate(engine, prompt, adapter, SamplingParams(max_tokens=24, temperature=0, stop=(stop,),
                                                                       include_stop_str_in_output=True))
    assert reason == "stop" and kept == full[: full.index(stop) + len(stop)]


def test_stop_strings_count_only_past_min_tokens(make_engine, manifest, adapter_names):
    engine = make_engine()
    prompt, adapter = manifest["prompts"][0], adapter_names[0]
    full, tokens, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=24, temperature=0, min_tokens=24))
    first = engine.tokenizer.decode(tokens[:1], skip_special_tokens=True)
    text, got, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=24, temperature=0, min_tokens=24,
                                                                    stop=(first,)))
    assert got == tokens and text == full and full.startswith(first)
    text, got, _ = generate(engine, prompt, adapter, SamplingParams(max_tokens=24, temperature=0, min_tokens=1,
                                                                    stop=(first,)))
    assert len(got) < 24


def test_skip_special_tokens_false_shows_them(make_engine):
    engine = make_engine(register=False)
    eos = engine.tokenizer.eos_token_id
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias=((eos, 100.0),))
    hidden, tokens, _ = generate(engine, "hello", None, SamplingParams(**forced))
    shown, _, _ = generate(engine, "hello", None, SamplingParams(**forced, skip_special_tokens=False))
    assert tokens == [eos] * 3 and hidden == "" and shown == engine.tokenizer.eos_token * 3
