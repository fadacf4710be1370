"""What a sampled token does to its request: its text (incremental detokenization), stops, the finish reason, and the
RequestOutput the engine hands to the client. Runs on the engine thread, once per sampled row per step."""

from __future__ import annotations

import time

from app.engine.detokenizer import IncrementalText
from app.sampling.logprobs import TokenLogprob
from app.engine.request import Request, RequestOutput
from app.sampling.structured import InvalidResponseFormat


def append_token(request: Request, token: int, logprob, tokenizer, eos_ids: set[int],
                 max_model_len: int) -> RequestOutput:
    """Add `token` to the request's output and return what the client gets for it (a text delta, possibly empty);
    sets request.finish_reason when the token ends the request."""
    if request.first_token_at is None:
        request.first_token_at = time.perf_counter()
    params = request.params
    if params.max_tokens == 0:  # echo: the prompt (and its logprobs) only
        request.finish_reason = "length"
        return make_output(request, "", ())
    if request.grammar is not None and request.grammar.is_dead_end:
        return _dead_end(request)
    request.output_ids.append(token)
    if request.grammar is not None:
        request.grammar.advance(token)
    finish = None
    if (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
        finish = "stop"  # min_tokens masked these tokens until now (app/sampling/penalties.py)
    detokenizer = request.detokenizer
    if detokenizer is None:
        detokenizer = request.detokenizer = IncrementalText(tokenizer, params.skip_special_tokens)
    # As vLLM: the stop token's text is left out unless include_stop_str_in_output.
    exact = finish is not None and not params.include_stop_str_in_output
    text = detokenizer.full() if exact else detokenizer.push(token)
    # As vLLM, stop strings count only past min_tokens.
    past_min = len(request.output_ids) > params.min_tokens
    found = request.stop_checker.match(text, request.emitted) if past_min else None
    if found is not None:
        at, stop = found
        text, finish = text[:at + len(stop) if params.include_stop_str_in_output else at], "stop"
    elif finish is None and request.grammar is not None and request.grammar.is_finished:
        finish = "stop"  # the JSON is complete: nothing but EOS could follow
    elif finish is None and (len(request.output_ids) >= params.max_tokens
                             or len(request.prompt_ids) + len(request.output_ids) >= max_model_len):
        finish = "length"
    if finish and found is None and not exact:
        text = detokenizer.full()  # a stream ends with one full decode of its tokens
    end = len(text) if finish else request.stop_checker.safe_end(text)
    delta = text[request.emitted:end]
    request.emitted = max(request.emitted, end)
    request.finish_reason = finish
    return make_output(request, delta, (token,), logprobs=() if logprob is None else (logprob,))


def _dead_end(request: Request) -> RequestOutput:
    """The grammar allowed no token at all this step, so the sampled one is not output: the request ends with an
    error, and the rest of the batch goes on."""
    request.finish_reason = "error"
    return make_output(request, "", (), error=InvalidResponseFormat(
        f"response_format's grammar allows no next token after {len(request.output_ids)} generated tokens, so "
        "the output cannot be completed; a subschema with no finite instance (one that refers only to itself) "
        "leads here"))


def make_output(request: Request, text: str, tokens: tuple, error=None, logprobs=()) -> RequestOutput:
    """The request's output for this step; the first one carries the prompt's logprobs if it asked for them."""
    prompt_logprobs = None
    if request.params.prompt_logprobs is not None and not request.prompt_logprobs_sent and error is None:
        request.prompt_logprobs_sent = True
        prompt_logprobs = (TokenLogprob(request.prompt_ids[0], None),) + tuple(request.prompt_logprobs)
    return RequestOutput(request.request_id, text, tokens, request.finish_reason is not None,
                         request.finish_reason, len(request.prompt_ids), len(request.output_ids), error,
                         logprobs, prompt_logprobs)
