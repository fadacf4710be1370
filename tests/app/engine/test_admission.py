"""The checks at submission, without a model: each failure's error and numbers, and the order they come in."""

import pytest

from app.engine.admission import Limits, check_request
from app.errors import AdapterNotFound, CapacityExceeded, InvalidRequest, PromptTooLong
from app.sampling.params import SamplingParams

LIMITS = Limits(vocab_size=100, max_prompt_tokens=8, kv_capacity_tokens=16, max_queue=2)


class Registry:
    def get(self, adapter_id):
        if adapter_id != "known":
            raise AdapterNotFound(f"adapter {adapter_id!r} is not registered")


def tokenizer(text):
    if "\ud800" in text:
        raise ValueError("lone surrogate")
    return {"input_ids": [ord(c) % 100 for c in text]}


def check(prompt, adapter_id=None, queued=0, **params):
    params = SamplingParams(**{"max_tokens": 4, **params})
    return check_request(prompt, adapter_id, params, Registry(), tokenizer, LIMITS, queued)


def test_a_request_within_every_limit_gets_its_prompt_ids():
    assert check("abc", "known") == [97, 98, 99]
    assert check([1, 2, 3], max_tokens=14) == [1, 2, 3]  # 3 + 14 - 1 = 16 tokens cached: exactly the cache


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt="abc", adapter_id="other"), AdapterNotFound, "'other'"),
    (dict(prompt=[1, 100]), InvalidRequest, r"token ids must be integers in \[0, 100\)"),
    (dict(prompt=[1, "2"]), InvalidRequest, "token ids must be integers"),
    (dict(prompt="a\ud800"), InvalidRequest, "the prompt could not be tokenized: lone surrogate"),
    (dict(prompt=""), InvalidRequest, "the prompt is empty"),
    (dict(prompt="abc", stop_token_ids=[100]), InvalidRequest, r"stop_token_ids has token id 100, outside the vocab"),
    (dict(prompt="abcdefghi"), PromptTooLong, "the prompt has 9 tokens; the limit is 8"),
    (dict(prompt="abc", max_tokens=15), InvalidRequest,
     r"prompt \(3 tokens\) \+ max_tokens \(15\) exceeds the KV cache of this replica \(16 tokens\)"),
    (dict(prompt="abc", queued=2), CapacityExceeded, r"the queue holds 2 requests \(max_queue\)"),
])
def test_each_check_refuses_with_its_numbers(kwargs, error, message):
    with pytest.raises(error, match=message):
        check(**kwargs)


def test_checks_come_in_order_adapter_first_queue_last():
    with pytest.raises(AdapterNotFound):
        check("", "other", queued=5)
    with pytest.raises(PromptTooLong):
        check("abcdefghi", queued=5, max_tokens=50)


def test_limits_leave_the_model_one_position_to_sample_into():
    class Config:
        max_input_tokens, max_queue = 2048, 7

    assert Limits.of(Config, 100, 1024, 4096) == Limits(100, 1023, 4096, 7, 1024)
    assert Limits.of(Config, 100, 4096, 4096).max_prompt_tokens == 2048


def test_prompt_and_max_tokens_past_the_model_context_is_a_400_with_both_numbers():
    """Before, the engine stopped at the context with finish_reason "length" (2,044 of 3,000 tokens asked)."""
    limits = Limits(vocab_size=100, max_prompt_tokens=8, kv_capacity_tokens=64, max_queue=2, max_model_len=12)
    params = SamplingParams(max_tokens=10)
    with pytest.raises(InvalidRequest, match=r"maximum context length is 12 tokens; the request asks for 13 "
                                             r"\(3 in the prompt, 10 in max_tokens\)") as refusal:
        check_request("abc", None, params, Registry(), tokenizer, limits, 0)
    assert refusal.value.status_code == 400
    assert check_request("abc", None, SamplingParams(max_tokens=9), Registry(), tokenizer, limits, 0) == [97, 98, 99]
