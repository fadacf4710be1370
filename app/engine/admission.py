"""The checks a request passes before it is queued: pure functions of the request and the replica's limits,
made once at submission, each failure with its own error and numbers."""

from __future__ import annotations

from dataclasses import dataclass

from app.adapters.registry import AdapterRegistry
from app.engine.config import EngineConfig
from app.errors import CapacityExceeded, InvalidRequest, PromptTooLong
from app.sampling.params import SamplingParams


@dataclass(frozen=True)
class Limits:
    """What one replica admits."""

    vocab_size: int
    max_prompt_tokens: int
    kv_capacity_tokens: int  # what one request could hold if it had the whole KV cache
    max_queue: int
    max_model_len: int | None = None  # the model's context (max_position_embeddings)

    @classmethod
    def of(cls, config: EngineConfig, vocab_size: int, max_model_len: int, kv_capacity_tokens: int) -> Limits:
        """A prompt leaves room in the model's context for one sampled token."""
        return cls(vocab_size, min(config.max_input_tokens, max_model_len - 1), kv_capacity_tokens, config.max_queue,
                   max_model_len)


def check_request(prompt: str | list[int], adapter_id: str | None, params: SamplingParams,
                  registry: AdapterRegistry, tokenizer, limits: Limits, queued: int) -> list[int]:
    """The request's prompt token ids, once it passes every check (in this order: its adapter is registered, its
    prompt is valid ids or text that tokenizes, and not empty; its sampling params fit the vocabulary; the prompt
    is within the limit; prompt and max_tokens fit the model's context, as vLLM counts it, and the KV cache; the
    queue, `queued` long, has room). Past the context the model would have to stop early with finish_reason
    "length": the request is refused instead, so no output is cut short without a word."""
    if adapter_id is not None:
        registry.get(adapter_id)  # AdapterNotFound
    prompt_ids = prompt_token_ids(prompt, tokenizer, limits.vocab_size)
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty")
    params.token_ids_in(limits.vocab_size)
    limit = limits.max_prompt_tokens
    if len(prompt_ids) > limit:
        raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the limit is {limit}")
    context = limits.max_model_len
    if context is not None and len(prompt_ids) + params.max_tokens > context:
        raise InvalidRequest(
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} in the prompt, {params.max_tokens} in "
            "max_tokens); lower max_tokens or shorten the prompt"
        )
    capacity = limits.kv_capacity_tokens
    if len(prompt_ids) + params.max_tokens - 1 > capacity:  # the last token is sampled, never cached
        raise InvalidRequest(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache of "
            f"this replica ({capacity} tokens); lower max_tokens"
        )
    if queued >= limits.max_queue:
        raise CapacityExceeded(f"the queue holds {queued} requests (max_queue)", retry_after_s=1.0)
    return prompt_ids


def prompt_token_ids(prompt: str | list[int], tokenizer, vocab_size: int) -> list[int]:
    """Token ids as given (each checked against the vocabulary), or the text's tokens."""
    if isinstance(prompt, list):
        prompt_ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt_ids):
            raise InvalidRequest(f"token ids must be integers in [0, {vocab_size})")
        return prompt_ids
    try:
        return tokenizer(prompt)["input_ids"]
    except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
        raise InvalidRequest(f"the prompt could not be tokenized: {e}") from e
