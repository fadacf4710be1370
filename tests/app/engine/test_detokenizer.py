"""Incremental detokenization equals a full decode after every token, on the demo's byte-level BPE, on a
SentencePiece-style tokenizer (whose leading space depends on context), and where it must fall back."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from app.demo import text as demo_text
from app.engine.detokenizer import IncrementalText, native_decode


def _streams(vocab: int, count: int = 12, length: int = 160, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _check_every_prefix(tokenizer, streams, skip: bool) -> None:
    for ids in streams:
        text = IncrementalText(tokenizer, skip)
        for i, token in enumerate(ids):
            assert text.push(token) == tokenizer.decode(ids[: i + 1], skip_special_tokens=skip), (ids[: i + 1],)
        assert text.full() == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_demo_tokenizer_every_prefix_equals_a_full_decode(demo_dir, skip):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "base")
    # random ids split multi-byte characters across tokens and put special tokens anywhere
    _check_every_prefix(tokenizer, _streams(len(tokenizer)), skip)
    text = "Ahoy, ñandú! 🦜 says the parrot. </s> The end."
    _check_every_prefix(tokenizer, [tokenizer(text, add_special_tokens=False).input_ids], skip)


def test_an_unfinished_character_shows_as_the_full_decode_shows_it(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "base")
    ids = tokenizer("🦜🦜", add_special_tokens=False).input_ids
    assert len(ids) > 2  # byte-level pieces of the 4-byte characters
    text = IncrementalText(tokenizer, True)
    seen = [text.push(t) for t in ids]
    assert seen[0].endswith("\ufffd") and seen[-1] == "🦜🦜"


def test_filled_8b_shape_vocabulary(demo_dir):
    tokenizer = demo_text.build_tokenizer(2048, vocab=demo_text.TOKENIZER_VOCAB + 500)
    _check_every_prefix(tokenizer, _streams(len(tokenizer), count=4), True)


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: words carry their leading space as U+2581, which a decode drops at its start."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [" ".join(demo_text.sentences())] * 2
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("skip", [True, False])
def test_a_context_dependent_leading_space_is_decoded_in_context(skip):
    tokenizer = _metaspace_tokenizer()
    words = tokenizer("The captain sailed the ship home at dawn", add_special_tokens=False).input_ids
    assert tokenizer.decode(words[1:2]) != tokenizer.decode(words[:2])[len(tokenizer.decode(words[:1])):]
    _check_every_prefix(tokenizer, [words] + _streams(len(tokenizer), count=6), skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_in_full():
    tokenizer = _metaspace_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    text = IncrementalText(tokenizer, True)
    assert not text.windowed
    ids = tokenizer("Ahoy , matey . Ready ?", add_special_tokens=False).input_ids
    for i, token in enumerate(ids):
        assert text.push(token) == tokenizer.decode(ids[: i + 1], skip_special_tokens=True)


class _Shouting(PreTrainedTokenizerFast):
    def _decode(self, *args, **kwargs) -> str:
        return super()._decode(*args, **kwargs).upper()


def test_the_backend_decodes_only_where_it_equals_the_tokenizers_decode(demo_dir):
    assert native_decode(AutoTokenizer.from_pretrained(demo_dir / "base")) is not None
    metaspace = _metaspace_tokenizer()
    assert native_decode(metaspace) is not None
    shouting = _Shouting(tokenizer_object=metaspace.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                         unk_token="<unk>")
    assert native_decode(shouting) is None  # a tokenizer with its own decode keeps it
    _check_every_prefix(shouting, _streams(len(shouting), count=2), True)
    metaspace.clean_up_tokenization_spaces = True
    assert native_decode(metaspace) is None
