"""OpenAI-compatible response bodies and stream chunks, with logprobs in each route's format.

A replica sends each choice's output as ChoiceChunks (app/api/wire.py); `Choice` turns them into the route's
fields, the same way for a stream and for a whole response (which is one merged chunk per choice).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence

from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from transformers.convert_slow_tokenizer import bytes_to_unicode

from app.api.schemas import Generation
from app.api.wire import ChoiceChunk
from app.sampling.logprobs import TokenLogprob


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@functools.cache
def _byte_of() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, as transformers defines it) reversed: character -> the byte it stands for."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The token's own bytes, which OpenAI's `bytes` field carries so that a client can rebuild characters
    split across tokens (decoding such a token alone gives U+FFFD, whose bytes are not the token's)."""
    if token_id not in getattr(tokenizer, "added_tokens_decoder", {}):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if isinstance(decoder, ByteLevelDecoder) and piece is not None:
            byte_of = _byte_of()
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
        elif piece is not None and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


class Choice:
    """One choice's text and logprobs as they stream; `echo_text` is its prompt, shown first with echo."""

    def __init__(self, index: int, tokenizer, generation: Generation, chat: bool, echo_text: str | None = None):
        self.index, self.tokenizer, self.generation, self.chat = index, tokenizer, generation, chat
        self.echo_text = echo_text
        self.offset = 0  # characters returned so far: the next token's text_offset
        self.finish_reason: str | None = None
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    def piece(self, chunk: ChoiceChunk) -> tuple[str, dict | None]:
        """This chunk's text and logprobs (None unless asked); the prompt (echo) comes with the first."""
        text, entries = chunk.text, list(chunk.logprobs)
        prompt_entries: list[TokenLogprob] = []
        if self.echo_text is not None:
            text, self.echo_text = self.echo_text + text, None
            prompt_entries = list(chunk.prompt_logprobs or ())
        self.finish_reason = chunk.finish_reason or self.finish_reason
        logprobs = None
        if self.generation.logprobs is not None:
            logprobs = (self._chat_logprobs(entries) if self.chat
                        else self._completion_logprobs(prompt_entries + entries))
        self.offset += len(text)
        return text, logprobs

    def _decode(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._token_text[token_id]

    def _completion_logprobs(self, entries: Sequence[TokenLogprob]) -> dict:
        """OpenAI's legacy shape: the sampled token joins its top-k dict, so it has up to k + 1 entries."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offset
        for entry in entries:
            token = self._decode(entry.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(entry.logprob)
            top = None
            if entry.logprob is not None:
                top = {self._decode(t): lp for t, lp in entry.top[: self.generation.logprobs]}
                top.setdefault(token, entry.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
        return out

    def _bytes(self, token_id: int) -> list[int]:
        if token_id not in self._token_bytes:
            self._token_bytes[token_id] = list(token_bytes(self.tokenizer, token_id))
        return self._token_bytes[token_id]

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            return {"token": self._decode(token_id), "logprob": logprob, "bytes": self._bytes(token_id)}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in e.top[: self.generation.logprobs]]}
                            for e in entries]}

    def body(self, chunk: ChoiceChunk) -> dict:
        """The whole choice, from its one merged chunk."""
        text, logprobs = self.piece(chunk)
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": chunk.finish_reason}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": chunk.finish_reason}

    def delta(self, chunk: ChoiceChunk) -> dict | None:
        """The stream chunk's choice for this replica chunk, or None when it carries nothing."""
        text, logprobs = self.piece(chunk)
        finish = chunk.finish_reason
        if not text and not finish and not (chunk.logprobs and logprobs):
            return None
        if self.chat:
            return {"index": self.index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def total_usage(chunks: Sequence[ChoiceChunk], n: int) -> dict:
    """Each prompt's tokens count once (its first choice), every choice's completion tokens count."""
    return usage(sum(c.prompt_tokens for c in chunks if c.index % n == 0),
                 sum(c.completion_tokens for c in chunks))


def body(request_id: str, model: str, chat: bool, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": model, "choices": choices, "usage": usage_}


def chunk(request_id: str, model: str, chat: bool, choices: list[dict], usage_: dict | None = None) -> dict:
    out = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(),
           "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
