"""What the ingress and a replica exchange (app/api/wire.py): it survives pickling, errors keep their status and
body, and a stream's chunks merge into one per choice."""

import pickle

import pytest

from app.api.fanout import merge_chunks
from app.api.wire import ChoiceChunk, ErrorReply, GenerateCall
from app.errors import CapacityExceeded, SchemaViolation, UnsupportedField
from app.sampling.logprobs import TokenLogprob
from app.sampling.params import SamplingParams
from app.sampling.structured import InvalidResponseFormat


def chunk(index: int, text: str, token_ids: tuple, finish: str | None = None, completion_tokens: int = 0,
          **kw) -> ChoiceChunk:
    return ChoiceChunk(index=index, text=text, token_ids=token_ids, finish_reason=finish, prompt_tokens=4,
                       completion_tokens=completion_tokens, replica="r1", **kw)


def test_every_shape_crosses_pickling_unchanged():
    lp = (TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.0))),)
    items = [GenerateCall(prompts=["hi", [1, 2]], params=SamplingParams(max_tokens=3, stop=("x",)), n=2,
                          adapter_id="pirate", request_id="cmpl-1"),
             chunk(0, "a", (7,), logprobs=lp, prompt_logprobs=(TokenLogprob(1, None),)),
             ErrorReply.of(CapacityExceeded("full", retry_after_s=2))]
    for item in items:
        assert pickle.loads(pickle.dumps(item)) == item


def test_an_error_reply_keeps_status_body_and_retry_after_of_any_serving_error():
    """UnsupportedField takes an argument of its own, so as an exception it would not unpickle; InvalidResponseFormat
    adds to its body. As replies both carry everything the HTTP response needs."""
    assert ErrorReply.of(CapacityExceeded("full", retry_after_s=2)) == ErrorReply(
        429, {"error": {"message": "full", "type": "rate_limit_error", "code": "capacity_exceeded"}}, 2)
    refused = ErrorReply.of(UnsupportedField("suffix", "suffix is not supported"))
    assert refused.status == 400 and refused.body["error"]["code"] == "unsupported_parameter"
    schema = InvalidResponseFormat("bad schema")
    assert ErrorReply.of(schema) == ErrorReply(400, schema.to_openai())
    assert ErrorReply.of(schema).body["error"]["param"] == "response_format"
    assert ErrorReply.of(SchemaViolation("n: too big")).status == 422


def test_a_call_needs_prompts_and_n():
    with pytest.raises(ValueError, match="n=0"):
        GenerateCall(prompts=["hi"], params=SamplingParams(), n=0)
    with pytest.raises(ValueError, match="0 prompts"):
        GenerateCall(prompts=[], params=SamplingParams())


def test_chunks_merge_into_one_per_choice_in_index_order():
    lp = [TokenLogprob(t, -0.1 * t) for t in range(4)]
    prompt_lp = (TokenLogprob(1, None), TokenLogprob(2, -0.3))
    stream = [chunk(1, "x", (5,), completion_tokens=1, logprobs=(lp[0],)),
              chunk(0, "He", (1,), completion_tokens=1, prompt_logprobs=prompt_lp),
              chunk(1, "y", (6,), "length", 2, logprobs=(lp[1],)),
              chunk(0, "llo", (2, 3), "stop", 3)]
    first, second = merge_chunks(stream)
    assert first == chunk(0, "Hello", (1, 2, 3), "stop", 3, prompt_logprobs=prompt_lp)
    assert second == chunk(1, "xy", (5, 6), "length", 2, logprobs=(lp[0], lp[1]))
