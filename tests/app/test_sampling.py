"""Sampling parameters and stop strings (the batched sampler: test_sampler.py)."""

import pytest

from app.errors import InvalidRequest
from app.sampling import SamplingParams, StopChecker
from engine_helpers import run_all


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", 3.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0)])
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
