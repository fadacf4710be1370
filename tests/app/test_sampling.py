import pytest
import torch

from app.errors import InvalidRequest
from app.sampling import SamplingParams, StopChecker, make_generator, sample
from engine_helpers import run_all


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)
    draws = [[int(sample(logits, params, g)) for _ in range(5)] for g in
             (make_generator(params, torch.device("cpu")) for _ in range(2))]
    assert draws[0] == draws[1]
    assert int(sample(logits, SamplingParams(temperature=0), None)) == int(logits.argmax())


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([5.0, 4.0, 1.0, 0.0])
    for seed in range(20):
        top_k = SamplingParams(temperature=1.0, top_k=2, seed=seed)
        assert int(sample(logits, top_k, make_generator(top_k, torch.device("cpu")))) in (0, 1)
        top_p = SamplingParams(temperature=1.0, top_p=0.5, seed=seed)
        assert int(sample(logits, top_p, make_generator(top_p, torch.device("cpu")))) == 0


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
