"""Incremental detokenization: a request's output text grows by decoding a short window of its newest
tokens, not all of them, so the host's cost per token stays flat as outputs grow.

Decoding every output token again on every step would cost O(n) per token, so the host time after each
decode step would grow with the outputs until it dominated the step.

The window starts at the last settled chunk of tokens (`prefix_offset`), and the text the new tokens add is
the window's decode less that chunk's, so a tokenizer that changes a token's text by what precedes it
(SentencePiece's leading space) is decoded in context. A window whose text ends in U+FFFD (an unfinished
multi-byte character) does not settle until a later token completes it. This is the usual windowed scheme of
streaming servers; written here because transformers' own streamers decode for printing, not for a server's
per-request state.

Where the scheme could diverge from one full decode, `IncrementalText` decodes in full instead: tokenizers
that clean up tokenization spaces (their cleanup looks at neighbouring words). A finished request's text is
always one full decode of its tokens, so what a stream ends with equals `tokenizer.decode` exactly.
"""

from __future__ import annotations


def native_decode(tokenizer):
    """`decode(ids, skip_special_tokens=...)` equal to `tokenizer.decode`, or None. Where a tokenizer decodes as
    transformers' fast tokenizers do and cleans up no spaces, its decode is its `tokenizers` backend's decode of
    the same ids, wrapped in Python that costs several times the decode itself (once per row and step)."""
    from transformers import PreTrainedTokenizerBase  # here: the modules that import this one may not need them
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer.decode
    return None


class IncrementalText:
    """The decoded text of a growing token list.

    `push(token)` adds a token and returns `tokenizer.decode` of every token pushed (any unfinished character at
    the end shows as U+FFFD, as in a full decode), from a decode of the newest few tokens."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the decode of ids[:read_offset]
        self.prefix_offset = 0  # the window's first token: decoded again for context
        self.read_offset = 0
        self.windowed = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._native = native_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._native is not None:
            return self._native(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token: int) -> str:
        self.ids.append(token)
        if not self.windowed:
            return self.full()
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if not window.startswith(prefix):  # the new token changed text before it: decode in full this time
            return self.full()
        tail = window[len(prefix):]
        if tail and not tail.endswith("\ufffd"):  # settled: the window moves on
            self.text += tail
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self.text
        return self.text + tail

    def full(self) -> str:
        return self._decode(self.ids)
