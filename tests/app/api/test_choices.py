"""n choices and batch prompts through the AsyncEngine (app/api/fanout.py), as OpenAI bodies (app/api/responses.py)."""

import asyncio
from dataclasses import replace

import pytest

from app.api.fanout import generate_choices, merge_chunks, output_chunk
from app.api.responses import Choice, token_bytes, total_usage
from app.api.schemas import ChatCompletionRequest, CompletionRequest
from app.api.wire import ChoiceChunk
from app.engine.async_engine import AsyncEngine
from app.errors import PromptTooLong
from app.sampling.params import SamplingParams
from engine_helpers import run_all
from routing.wire import Hint


@pytest.fixture
def engine(make_engine):
    engine = AsyncEngine(make_engine(max_input_tokens=64))
    yield engine
    engine.shutdown()


def stream(engine, prompts, params, n, adapter=None) -> list[ChoiceChunk]:
    async def main():
        return [output_chunk(i, o) async for i, o in generate_choices(engine, prompts, adapter, params, n)]

    return asyncio.run(main())


def test_n_seeded_choices_equal_single_requests_with_seed_plus_j(engine, make_engine, adapter_names):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=100)
    prompts = ["Tell me about the sea.", [1, 50, 60, 70]]
    merged = merge_chunks(stream(engine, prompts, params, 3, adapter_names[0]))
    assert [c.index for c in merged] == list(range(6))
    sync = make_engine()
    for c in merged:
        i, j = divmod(c.index, 3)
        request = sync.add_request(prompts[i], adapter_names[0], replace(params, seed=100 + j))
        assert list(c.token_ids) == run_all(sync)[request.request_id], c.index
    assert len({c.token_ids for c in merged[:3]}) > 1, "the n choices should differ"


def test_a_bad_prompt_fails_the_whole_request_before_anything_streams(engine):
    got = []

    async def main():
        async for item in generate_choices(engine, ["fine", "word " * 100], None, SamplingParams(max_tokens=4), 2):
            got.append(item)

    with pytest.raises(PromptTooLong):
        asyncio.run(main())
    assert got == []
    assert asyncio.run(engine.call(lambda e: (len(e.running), len(e.waiting)))) == (0, 0)


@pytest.mark.parametrize("prompts, n", [(["a", "b"], 2), (["a"], 1)])  # merged choices, and the one-choice path
def test_leaving_early_aborts_every_choice(engine, prompts, n):
    async def main():
        async for _ in generate_choices(engine, prompts, None, SamplingParams(max_tokens=500, ignore_eos=True), n):
            break
        for _ in range(200):
            if not await engine.call(lambda e: e.has_requests()):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_completion_body_with_echo_logprobs_and_batch_prompts(engine, make_engine):
    body = CompletionRequest(model="base", prompt=["Tell me", "Describe"], n=2, echo=True, logprobs=2, max_tokens=3,
                             temperature=0)
    generation = body.generation(16)
    merged = merge_chunks(stream(engine, body.prompts(), generation.params, 2))
    tokenizer = engine.engine.tokenizer
    choices = [Choice(i, tokenizer, generation, False, body.prompts()[i // 2]).body(c) for i, c in enumerate(merged)]
    for choice in choices:
        prompt = body.prompts()[choice["index"] // 2]
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt_ids) + 3 == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert choices[0]["text"] == choices[1]["text"]  # greedy: both choices of a prompt agree
    usage = total_usage(merged, 2)
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == sum(len(tokenizer(p)["input_ids"]) for p in body.prompts())


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(engine):
    body = CompletionRequest(model="base", prompt="Tell me about the sea.", echo=True, logprobs=1, max_tokens=0)
    generation = body.generation(16)
    merged = merge_chunks(stream(engine, body.prompts(), generation.params, 1))
    choice = Choice(0, engine.engine.tokenizer, generation, False, body.prompt).body(merged[0])
    assert choice["text"] == body.prompt and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == merged[0].prompt_tokens


def test_chat_logprobs_and_streamed_deltas_carry_their_index(engine):
    body = ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True,
                                 top_logprobs=3, max_tokens=4, temperature=0.8, seed=1)
    generation = body.generation(16)
    chunks = stream(engine, [[1, 4, 30, 31]], generation.params, 2)
    tokenizer = engine.engine.tokenizer
    choices = [Choice(i, tokenizer, generation, True) for i in range(2)]
    deltas = [d for d in (choices[c.index].delta(c) for c in chunks) if d is not None]
    for index in (0, 1):
        mine = [d for d in deltas if d["index"] == index]
        content = [e for d in mine for e in d["logprobs"]["content"]]
        assert len(content) == 4 and mine[-1]["finish_reason"] == "length"
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(entry["top_logprobs"]) == 3
            assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        text = "".join(d["delta"].get("content", "") for d in mine)
        assert text == tokenizer.decode([t for c in chunks if c.index == index for t in c.token_ids],
                                        skip_special_tokens=True)
        assert bytes(b for e in content for b in e["bytes"]).decode() == text  # the tokens' own bytes


def test_token_bytes_rebuild_characters_split_across_tokens(engine):
    """Decoding a token that holds part of a character gives U+FFFD; its bytes field must hold its own bytes."""
    tokenizer = engine.engine.tokenizer
    text = "héllo 😀 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case that matters is in there
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()
    eos = tokenizer.eos_token_id  # an added special token: its text
    assert token_bytes(tokenizer, eos) == tokenizer.decode([eos], skip_special_tokens=False).encode()


def test_the_routers_hint_is_consumed_once_per_request_by_its_first_choice(engine, manifest, adapter_names):
    adapter = adapter_names[0]

    async def main():
        engine.hint([Hint(adapter, "serve-1")])
        async for _ in generate_choices(engine, [manifest["prompts"][0]] * 2, adapter, SamplingParams(max_tokens=2),
                                        n=2, request_id="cmpl-1", hint_id="serve-1"):
            pass
        return await engine.call(lambda e: (e.metrics(), e.hints.demand(), e.hint_lead.count))

    metrics, demand, leads = asyncio.run(main())
    assert demand == [] and leads == 1 and metrics["hints_late"] == 0  # four engine requests, one hint
