"""Structured output (response_format) on the tiny demo: the output parses and validates against the schema
(checked with jsonschema, not with the grammar library), bad schemas are a 400 naming the field, and the
grammar mask touches only the constrained rows."""

import asyncio
import json
import pickle
import re
import threading
from dataclasses import asdict, replace

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from app.api.schemas import ChatCompletionRequest, CompletionRequest
from app.engine.async_engine import AsyncEngine
from app.engine.engine import LLMEngine
from app.engine.process import EngineProcess
from app.errors import UnsupportedField
from app.api.fanout import generate_choices, merge_chunks, output_chunk
from app.api.responses import Choice
from app.sampling.params import SamplingParams
from app.sampling.structured import InvalidResponseFormat, apply_bitmask, json_object_spec, json_schema_spec, unpack
from engine_helpers import engine_config, greedy

PROMPT = "Tell me about the sea."
# Small enough that the tiny random model finishes it well within max_tokens.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["sea", "sky", "tree"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
BAD_SCHEMAS = [{"type": "frobnicate"}, {"type": "string", "pattern": "(("}, {"$ref": "#/defs/missing"},
               {"type": "integer", "minimum": 5, "maximum": 1}]


@pytest.fixture(scope="module")
def engine(demo_dir):
    engine = LLMEngine(engine_config(demo_dir))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_engine(demo_dir):
    engine = AsyncEngine(LLMEngine(engine_config(demo_dir)))
    yield engine
    engine.shutdown()


def generate(engine, requests: list[tuple[str, SamplingParams]]) -> list[tuple[str, str]]:
    """(finish_reason, text as streamed) of each request, all run in one batch."""
    added = [engine.add_request(prompt, None, params) for prompt, params in requests]
    texts = {r.request_id: "" for r in added}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            texts[output.request_id] += output.text
        engine.check_invariants()
    return [(r.finish_reason, texts[r.request_id]) for r in added]


def sampled(seed: int, spec: str | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed, response_format=spec, **kw)


def test_json_object_output_parses_to_an_object(engine):
    for finish, text in generate(engine, [(PROMPT, sampled(seed, json_object_spec())) for seed in range(4)]):
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_json_schema_output_validates(engine):
    spec = json_schema_spec(PERSON)
    outputs = generate(engine, [(PROMPT, sampled(seed, spec)) for seed in range(4)]
                       + [(PROMPT, greedy(120, response_format=spec))])
    for finish, text in outputs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for _, text in outputs}) > 1, "seeded samples should differ"
    assert list(json.loads(outputs[0][1])) == list(PERSON["properties"]), "properties come in the schema's order"


def test_greedy_constrained_output_is_deterministic_and_batch_independent(engine):
    spec = json_schema_spec(PERSON)
    alone = generate(engine, [(PROMPT, greedy(120, response_format=spec))])
    again = generate(engine, [(PROMPT, greedy(120, response_format=spec))])
    crowded = generate(engine, [("Say something.", greedy(30)), (PROMPT, greedy(120, response_format=spec)),
                                ("Once upon a time", sampled(3))])
    assert alone == again == crowded[1:2]


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(engine):
    plain = [("Say something.", greedy(30)), ("Once upon a time", replace(sampled(5), max_tokens=30))]
    alone = generate(engine, plain)
    mixed = generate(engine, [plain[0], (PROMPT, sampled(1, json_schema_spec(PERSON))),
                              (PROMPT, greedy(120, response_format=json_object_spec())), plain[1]])
    assert [mixed[0], mixed[3]] == alone


def test_max_tokens_cuts_a_constrained_output_honestly(engine):
    spec = json_schema_spec(PERSON)
    [(finish, text), (_, whole)] = generate(engine, [(PROMPT, greedy(5, response_format=spec)),
                                                     (PROMPT, greedy(120, response_format=spec))])
    assert finish == "length" and whole.startswith(text) and len(text) < len(whole)  # a prefix of valid JSON


def test_the_grammar_ends_the_output_despite_ignore_eos_and_min_tokens(engine):
    spec = json_schema_spec(PERSON)
    outputs = generate(engine, [(PROMPT, greedy(120, response_format=spec, ignore_eos=True)),
                                (PROMPT, greedy(120, response_format=spec, min_tokens=100))])
    for finish, text in outputs:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_penalties_and_logit_bias_still_give_valid_output(engine):
    spec = json_schema_spec(PERSON)
    quote = engine.tokenizer.convert_tokens_to_ids('"')
    outputs = generate(engine, [
        (PROMPT, sampled(2, spec, repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)),
        (PROMPT, greedy(120, response_format=spec, logit_bias=((quote, -100.0),)))])
    for finish, text in outputs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_stop_strings_still_cut_the_text(engine):
    [(_, whole)] = generate(engine, [(PROMPT, greedy(120, response_format=json_schema_spec(PERSON)))])
    [(finish, cut)] = generate(engine, [(PROMPT, greedy(120, response_format=json_schema_spec(PERSON),
                                                        stop=('"age"',)))])
    assert finish == "stop" and cut == whole[:whole.index('"age"')]


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
def test_a_bad_schema_is_a_400_naming_response_format_at_submission(engine, schema):
    with pytest.raises(InvalidResponseFormat) as refusal:
        engine.add_request(PROMPT, None, greedy(10, response_format=json_schema_spec(schema)))
    error = refusal.value.to_openai()["error"]
    assert refusal.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert not engine.has_requests()


def test_params_with_a_grammar_pickle_and_survive_asdict():
    params = greedy(10, response_format=json_schema_spec(PERSON))
    assert pickle.loads(pickle.dumps(params)) == params
    assert SamplingParams(**asdict(params)) == params


def test_apply_bitmask_masks_exactly_the_constrained_rows():
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[0, 31, 32, 69]] = True
    bits = torch.cat([allowed, torch.zeros(96 - vocab, dtype=torch.bool)]).view(3, 32).long()
    words = (bits << torch.arange(32)).sum(-1)  # bit j of word w is token 32 * w + j
    bitmask = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)[None]  # as uint32 bits in int32
    assert torch.equal(unpack(bitmask, vocab)[0], allowed)
    out = apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.equal(out[[0, 2]], logits[[0, 2]]), "unconstrained rows unchanged"
    assert torch.equal(out[1, allowed], logits[1, allowed]) and torch.isneginf(out[1, ~allowed]).all()
    assert not torch.isinf(logits).any(), "the raw logits (for logprobs) are not written"


# --- through the API layer: the request bodies, the AsyncEngine, the response bodies -----------------------


def chat_body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="base", messages=[{"role": "user", "content": PROMPT}], max_tokens=120, **kw)


def run_body(async_engine, body, prompts, chat: bool) -> list[dict]:
    body.check_supported()
    generation = body.generation(16)

    async def main():
        return [output_chunk(i, o) async for i, o in
                generate_choices(async_engine, prompts, None, generation.params, generation.n)]

    merged = merge_chunks(asyncio.run(main()))
    tokenizer = async_engine.engine.tokenizer
    return [Choice(c.index, tokenizer, generation, chat).body(c) for c in merged]


def test_chat_json_schema_with_n_logprobs_through_the_api_layer(async_engine):
    body = chat_body(n=3, seed=11, logprobs=True, top_logprobs=2, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    tokenizer = async_engine.engine.tokenizer
    text = tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=True, tokenize=False)
    choices = run_body(async_engine, body, [tokenizer(text, add_special_tokens=False)["input_ids"]], chat=True)
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        entries = choice["logprobs"]["content"]
        assert entries and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)


def test_completions_json_object_with_echo_through_the_api_layer(async_engine):
    body = CompletionRequest(model="base", prompt=PROMPT, max_tokens=120, temperature=0, echo=True,
                             response_format={"type": "json_object"})
    body.check_supported()
    generation = body.generation(16)

    async def main():
        return [output_chunk(i, o) async for i, o in
                generate_choices(async_engine, [PROMPT], None, generation.params, 1)]

    chunks = asyncio.run(main())
    [merged] = merge_chunks(chunks)
    [choice] = [Choice(0, async_engine.engine.tokenizer, generation, False, PROMPT).body(merged)]
    assert choice["text"].startswith(PROMPT) and isinstance(json.loads(choice["text"][len(PROMPT):]), dict)
    assert "".join(c.text for c in chunks) == merged.text, "streamed chunks join to the whole text"


def test_a_bad_schema_through_the_async_engine_is_a_400_before_anything_streams(async_engine):
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMAS[0]}})
    with pytest.raises(InvalidResponseFormat, match="frobnicate") as refusal:
        run_body(async_engine, body, [PROMPT], chat=True)
    assert refusal.value.to_openai()["error"]["param"] == "response_format"
    assert asyncio.run(async_engine.call(lambda e: e.has_requests())) is False


def test_grammars_compile_beside_the_engine_loop(async_engine):
    grammars, threads = async_engine.engine.grammars, []
    compile_ = grammars.compile

    def recording(spec):
        threads.append(threading.current_thread().name)
        return compile_(spec)

    grammars.compile = recording
    try:
        schema = {**PERSON, "title": "a schema no other test compiled"}
        run_body(async_engine, chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": schema}}), [PROMPT], chat=True)
    finally:
        del grammars.compile
    assert threads and threads[0] != "engine-loop", threads  # then add_request finds it in the cache


def test_response_format_schema_rules():
    for route_body in (chat_body, lambda **kw: CompletionRequest(model="base", prompt="hi", **kw)):
        assert route_body(response_format={"type": "text"}).generation(16).params.response_format is None
        with pytest.raises(UnsupportedField, match="response_format.extra") as refusal:
            route_body(response_format={"type": "json_object", "extra": 1}).check_supported()
        assert refusal.value.field == "response_format.extra"
        for bad in ({"type": "json_schema"}, {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
                    {"type": "grammar"}, {"type": "json_schema", "json_schema": {"schema": {}}},
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"a": "b" * 70000}}}):
            with pytest.raises(ValidationError):
                route_body(response_format=bad)


def test_structured_output_crosses_the_engine_process_pipe(demo_dir, engine):
    """The spec is a string in SamplingParams, compiled in the child; its 400 comes back up the pipe."""
    spec = json_schema_spec(PERSON)
    [expected] = generate(engine, [(PROMPT, greedy(120, response_format=spec))])
    process = EngineProcess(engine_config(demo_dir), start_timeout_s=300)

    async def main():
        text, last = "", None
        async for output in process.generate(PROMPT, None, greedy(120, response_format=spec)):
            text, last = text + output.text, output
        with pytest.raises(InvalidResponseFormat) as refusal:
            async for _ in process.generate(PROMPT, None, greedy(10, response_format=json_schema_spec(BAD_SCHEMAS[0]))):
                pass
        return (last.finish_reason, text), refusal.value

    try:
        got, error = asyncio.run(main())
    finally:
        process.shutdown()
    assert got == expected
    assert error.to_openai()["error"]["param"] == "response_format"


# Each of these compiled before, and xgrammar's grammar then let output through that the schema forbids
# (e.g. 2079341237477542 for the first): refused by name instead.
UNENFORCED = [
    ({"type": "integer", "multipleOf": 7, "minimum": 10}, "multipleOf", "schema"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "schema"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf", "schema"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"type": "string"}}, "if", "schema"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "schema"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not", "schema.properties.a"),
    ({"$defs": {"n": {"type": "integer", "multipleOf": 3}}, "$ref": "#/$defs/n"}, "multipleOf", "schema.$defs.n"),
    ({"type": "array", "items": {"type": "object", "properties": {"a": {}, "b": {}},
                                 "dependentRequired": {"a": ["b"]}}}, "dependentRequired", "schema.items"),
]


@pytest.mark.parametrize("schema, keyword, where", UNENFORCED, ids=[k for _, k, _ in UNENFORCED])
def test_a_keyword_the_grammar_does_not_enforce_is_a_400_naming_it(engine, schema, keyword, where):
    with pytest.raises(InvalidResponseFormat, match=f"json_schema.{re.escape(where)} uses '{re.escape(keyword)}'"):
        engine.add_request(PROMPT, None, greedy(10, response_format=json_schema_spec(schema)))
    assert not engine.has_requests()


def test_enforced_keywords_still_compile(engine):
    """A one-schema allOf (pydantic's way to describe a $ref), annotations, bounds, patterns and self-references."""
    schema = {"$defs": {"age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "type": "object", "title": "Person", "description": "someone",
              "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "default": "Ann"},
                             "age": {"allOf": [{"$ref": "#/$defs/age"}], "description": "in years"},
                             "friend": {"$ref": "#"}},
              "required": ["name", "age"]}
    request = engine.add_request(PROMPT, None, greedy(10, response_format=json_schema_spec(schema)))
    assert engine.has_requests()
    engine.abort(request.request_id)


# Schemas every instance of which contains another instance of themselves: xgrammar compiles them into a grammar
# that allows no token, or none that ever completes.
NO_FINITE_INSTANCE = [
    ({"$ref": "#"}, "schema -> schema"),
    ({"anyOf": [{"$ref": "#"}]}, "schema -> schema.anyOf[0] -> schema"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "schema.$defs.a -> schema.$defs.a"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     "schema -> schema.properties.a -> schema"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "schema -> schema.items -> schema"),
]


@pytest.mark.parametrize("schema, cycle", NO_FINITE_INSTANCE, ids=[c for _, c in NO_FINITE_INSTANCE])
def test_a_schema_with_no_finite_instance_is_a_400_naming_its_cycle(engine, schema, cycle):
    with pytest.raises(InvalidResponseFormat, match="has no finite instance: .* refers only to itself") as refusal:
        engine.add_request(PROMPT, None, greedy(10, response_format=json_schema_spec(schema)))
    assert f"({cycle})" in refusal.value.message
    assert refusal.value.status_code == 400 and refusal.value.to_openai()["error"]["param"] == "response_format"
    assert not engine.has_requests()


def test_a_schema_with_no_finite_instance_through_the_async_engine_is_a_400(async_engine):
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}})
    with pytest.raises(InvalidResponseFormat, match="schema has no finite instance: schema refers only to itself"):
        run_body(async_engine, body, [PROMPT], chat=True)
    assert asyncio.run(async_engine.call(lambda e: e.has_requests())) is False


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]},
               "b": {"type": "object", "properties": {"next": {"$ref": "#/$defs/a"}}, "required": ["next"]}},
     "$ref": "#/$defs/b"},
])
def test_a_recursion_that_can_end_still_compiles(engine, schema):
    request = engine.add_request(PROMPT, None, greedy(10, response_format=json_schema_spec(schema)))
    engine.abort(request.request_id)


def test_a_grammar_that_allows_no_token_mid_output_ends_only_its_request(engine):
    """An optional string property whose pattern matches no string: the object has instances ({}), but once the
    model opens that string the grammar allows nothing. Biasing '}' away makes greedy decoding walk into it.
    (xgrammar refuses the schemas that admit no value at all, such as a $ref that only refers to itself.)"""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[^\\s\\S]$"}}}
    close = engine.tokenizer.convert_tokens_to_ids("}")
    plain = ("Once upon a time", greedy(30))
    [alone] = generate(engine, [plain])
    stuck = engine.add_request(PROMPT, None, greedy(30, response_format=json_schema_spec(schema),
                                                    logit_bias=((close, -100.0),)))
    neighbour = engine.add_request(plain[0], None, plain[1])
    texts, errors = {stuck.request_id: "", neighbour.request_id: ""}, []
    while engine.has_work():
        for output in engine.step():
            texts[output.request_id] += output.text
            if output.error is not None:
                errors.append((output.request_id, output.finish_reason, output.error))
        engine.check_invariants()
    [(request_id, finish, error)] = errors
    assert request_id == stuck.request_id and finish == stuck.finish_reason == "error"
    assert isinstance(error, InvalidResponseFormat) and "allows no next token" in error.message
    assert texts[stuck.request_id] == '{"a": "', "what was streamed is the grammar's, no masked token follows"
    assert (neighbour.finish_reason, texts[neighbour.request_id]) == alone
    assert not engine.has_requests()
