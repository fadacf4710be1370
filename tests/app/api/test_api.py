"""The request schemas and their rule: every field is implemented or refused with a 400 naming it.

The walk below classifies every field the schemas declare. A field added to a schema without a row
here fails the test; an implemented field must change what the engine or the response gets; a refused
field, and any undeclared one, must raise UnsupportedField naming it.
"""

import pytest
from pydantic import ValidationError

from app.api.schemas import (MAX_CHOICES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                     LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from app.errors import UnsupportedField

COMMON_IMPLEMENTED = {
    "model": "pirate", "max_tokens": 5, "temperature": 0.5, "top_p": 0.5, "top_k": 4, "seed": 7, "stop": ["x"],
    "stream": True, "stream_options": {"include_usage": True}, "n": 2, "ignore_eos": True,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 3.0},
    "min_tokens": 2, "stop_token_ids": [9], "include_stop_str_in_output": True, "skip_special_tokens": False,
    "response_format": {"type": "json_object"},
}
NO_EFFECT = {"user": "someone"}  # accepted, changes nothing that is generated or returned
NEEDS = {"top_logprobs": {"logprobs": True}}  # set in the baseline too when walking this field
ROUTES = {
    "completions": (CompletionRequest, {"model": "base", "prompt": "hi"},
                    {**COMMON_IMPLEMENTED, "prompt": ["a", "b"], "echo": True, "logprobs": 3},
                    {"suffix": "end", "best_of": 3}),
    "chat": (ChatCompletionRequest, {"model": "base", "messages": [{"role": "user", "content": "hi"}]},
             {**COMMON_IMPLEMENTED, "messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}],
              "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 2},
             {"tools": [{"type": "function"}], "tool_choice": "auto"}),
}


def observable(body) -> tuple:
    """Everything a body hands on: the engine's parameters, the response's shape, the prompts."""
    prompts = body.prompts() if isinstance(body, CompletionRequest) else body.conversation()
    return body.generation(16), prompts, body.model


@pytest.mark.parametrize("route", ROUTES)
def test_every_declared_field_is_implemented_or_refused(route):
    schema, minimal, implemented, refused = ROUTES[route]
    assert set(schema.model_fields) == set(minimal) | set(implemented) | set(refused) | set(NO_EFFECT)
    baseline = schema(**minimal)
    baseline.check_supported()
    for name, value in implemented.items():
        base = schema(**{**minimal, **NEEDS.get(name, {})})
        body = schema(**{**minimal, **NEEDS.get(name, {}), name: value})
        body.check_supported()
        assert observable(body) != observable(base), f"{name} changes nothing"
    for name, value in NO_EFFECT.items():
        body = schema(**{**minimal, name: value})
        body.check_supported()
        assert observable(body) == observable(baseline)
    for name, value in refused.items():
        with pytest.raises(UnsupportedField, match=name) as refusal:
            schema(**{**minimal, name: value}).check_supported()
        assert refusal.value.field == name and refusal.value.status_code == 400


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["guided_json", "min_p", "functions", "echo_", "service_tier", "frobnicate"])
def test_undeclared_fields_are_refused_by_name(route, name):
    schema, minimal, _, _ = ROUTES[route]
    with pytest.raises(UnsupportedField, match=repr(name)) as refusal:
        schema(**{**minimal, name: None}).check_supported()
    assert refusal.value.field == name


def test_refused_fields_at_their_neutral_values_are_accepted():
    CompletionRequest(model="base", prompt="hi", suffix="", best_of=1).check_supported()
    CompletionRequest(model="base", prompt="hi", n=3, best_of=3).check_supported()
    ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "hi"}], tools=[],
                          tool_choice="none").check_supported()


def test_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(UnsupportedField, match="top_logprobs"):
        ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "hi"}],
                              top_logprobs=2).check_supported()


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert CompletionRequest(model="base", prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[True, False], [1.0, 2.0], [[1, True]], [[1.0]], [], [[]], [""], ["a", 1],
                                    [-1], ["x"] * 33])
def test_bad_prompts_are_schema_errors(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest(model="base", prompt=prompt)


def test_choice_and_token_limits():
    with pytest.raises(ValidationError, match="choices"):
        CompletionRequest(model="base", prompt=["a"] * 8, n=16)
    assert len(CompletionRequest(model="base", prompt=["a"] * 4, n=16).prompts()) * 16 == MAX_CHOICES
    with pytest.raises(ValidationError, match="echo"):
        CompletionRequest(model="base", prompt="a", max_tokens=0)
    assert CompletionRequest(model="base", prompt="a", max_tokens=0, echo=True).generation(16).params.max_tokens == 0


def test_logit_bias_is_clamped_and_keys_must_be_token_ids():
    body = CompletionRequest(model="base", prompt="a", logit_bias={"3": 250, "4": -1e9, "5": 0.5})
    assert body.generation(16).params.logit_bias == ((3, 100.0), (4, -100.0), (5, 0.5))
    for key in ("-1", "a", "1.5", "", "١"):
        with pytest.raises(ValidationError, match="logit_bias"):
            CompletionRequest(model="base", prompt="a", logit_bias={key: 1})


def test_chat_content_parts():
    def chat(content):
        return ChatCompletionRequest(model="base", messages=[{"role": "user", "content": content}])

    body = chat([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])
    body.check_supported()
    assert body.conversation() == [{"role": "user", "content": "one\ntwo"}]
    for part, named in [({"type": "image_url", "image_url": {"url": "x"}}, "image_url"),
                        ({"type": "input_audio"}, "input_audio"), ({"type": "text"}, "text"),
                        ({"type": "text", "text": "a", "cache_control": {}}, "cache_control")]:
        with pytest.raises(UnsupportedField, match=named):
            chat([part]).check_supported()
    with pytest.raises(UnsupportedField, match="name"):
        ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "hi", "name": "x"}]).check_supported()


def test_chat_max_completion_tokens_wins_and_seeds_follow_choices():
    body = ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                 max_completion_tokens=7, logprobs=True, top_logprobs=2)
    generation = body.generation(16)
    assert generation.params.max_tokens == 7 and generation.params.logprobs == 2 == generation.logprobs


@pytest.mark.parametrize("schema,minimal,name", [
    (LoadLoRAAdapterRequest, {"lora_name": "a", "lora_path": "/p"}, "load_inplace"),
    (UnloadLoRAAdapterRequest, {"lora_name": "a"}, "lora_int_id"),
    (TokenizeRequest, {"model": "base", "prompt": "hi"}, "return_token_strs"),
    (TokenizeRequest, {"model": "base", "messages": [{"role": "user", "content": "hi"}]}, "chat_template"),
    (DetokenizeRequest, {"model": "base", "tokens": [1]}, "skip_special_tokens"),
])
def test_vllm_route_bodies_refuse_undeclared_fields_by_name(schema, minimal, name):
    schema(**minimal).check_supported()
    with pytest.raises(UnsupportedField, match=repr(name)):
        schema(**{**minimal, name: None}).check_supported()


def test_tokenize_takes_exactly_one_input():
    for body in [{}, {"prompt": "a", "messages": [{"role": "user", "content": "hi"}]},
                 {"prompt": "a", "add_generation_prompt": True}]:
        with pytest.raises(ValidationError):
            TokenizeRequest(model="base", **body)
    with pytest.raises(UnsupportedField, match="image_url"):
        TokenizeRequest(model="base", messages=[{"role": "user", "content": [{"type": "image_url"}]}]).check_supported()
