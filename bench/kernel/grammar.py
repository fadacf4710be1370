"""Grammar libraries for structured output, compared at the demo's vocabulary and at a 128k one.

For xgrammar, llguidance and outlines-core (whichever import): tokenizer set-up and grammar compile
time (json_object, a small schema, a 60-property schema), then the per-token host cost of a
constrained row: fill its bitmask row and advance the matcher by the next token of a valid document
(tokenized as the model would write it), and the device cost of applying a [B, V/32] bitmask to
[B, V] logits (app/sampling/structured.py's `apply_bitmask`). There is no model hub here, so the 128k
tokenizer is a byte-level BPE trained to 128,256 tokens on generated text (`tokenizer_128k`).

    python -m bench.kernel.grammar            # writes bench/results/<device>-grammar-libs.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from app.sampling.structured import Grammar, GrammarCompiler, apply_bitmask, json_object_spec, json_schema_spec
from bench.common import REPO_DEMO, write_result

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "age", "tags"], "additionalProperties": False}
SMALL_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry of science"]}
BIG = {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(60)],
       "properties": {f"f{i}": [{"type": "integer"}, {"type": "string", "maxLength": 40},
                                {"enum": ["red", "green", "blue"]},
                                {"type": "array", "items": {"type": "number"}},
                                {"type": "object", "properties": {"x": {"type": "boolean"}}}][i % 5]
                      for i in range(60)}}
ANY_DOC = {"id": 7, "user": {"name": "Grace", "roles": ["admin", "dev"], "active": True},
           "scores": [1.5, -2, 3e4], "note": None, "text": "the quick brown fox jumps over the lazy dog"}


def tokenizer_128k(cache: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 128,256 tokens (Llama 3's size) trained on generated words, numbers and JSON."""
    path = cache / "tokenizer-128k.json"
    if not path.exists():
        rng = random.Random(0)
        cons, vows = "b c d f g h j k l m n p r s t v w z ch sh th st br tr pl gr".split(), "a e i o u ai ea ou".split()
        words = ["".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4))) for _ in range(400000)]

        def lines():
            for _ in range(200000):
                ws = [words[min(int(rng.paretovariate(0.7)), len(words)) - 1] for _ in range(12)]
                yield " ".join(ws) + rng.choice([". ", ", ", "\n"]) + json.dumps(
                    {ws[0]: rng.randint(0, 10 ** rng.randint(1, 6)), ws[1]: [ws[2], rng.random()]})

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(lines(), trainers.BpeTrainer(
            vocab_size=128256, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>", pad_token="<pad>")


class XGrammar:
    """What the engine runs (app/sampling/structured.py)."""

    def __init__(self, tokenizer):
        self.vocab, self.stop_ids = len(tokenizer), [tokenizer.eos_token_id]
        self.compiler = GrammarCompiler(tokenizer, self.vocab, self.stop_ids)
        self.compiler.compile(json_schema_spec({"type": "boolean"}))  # builds the tokenizer info: set-up time

    def compile(self, schema):
        return self.compiler.compile(json_object_spec() if schema is None else json_schema_spec(schema))

    def walk(self, compiled, tokens, bitmask):
        grammar = Grammar(compiled, self.vocab, self.stop_ids)
        for t in tokens:
            grammar.fill(bitmask, 0)
            assert grammar.advance(t), t


class LLGuidance:
    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema or {"type": "object"}, defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                    "key_separator": ": "})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, tokens, bitmask):
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        row = bitmask[0]
        for t in tokens:
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            assert matcher.consume_token(t), (t, matcher.get_error())


class OutlinesCore:
    def __init__(self, tokenizer):
        import outlines_core
        self.oc = outlines_core
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tokenizer.all_special_ids)
        by_bytes = {}
        for token, i in tokenizer.get_vocab().items():
            if i not in special:
                by_bytes.setdefault(bytes(byte_of[c] for c in token), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}), r" ?")
        return self.oc.Index(regex, self.vocabulary)

    def walk(self, index, tokens, bitmask):
        guide = self.oc.Guide(index)
        row = bitmask[0]
        for t in tokens:
            guide.write_mask_into(row.data_ptr(), row.numel(), 4)
            guide.advance(t)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


LIBRARIES = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}
CASES = {"json_object": (None, ANY_DOC), "small_schema": (SMALL, SMALL_DOC)}


def bench_library(lib, tokenizer, rounds: int) -> dict:
    vocab = len(tokenizer)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    out = {}
    for case, (schema, doc) in CASES.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        tokens = tokenizer(json.dumps(doc), add_special_tokens=False)["input_ids"]  # the engine's separators
        per_token = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            lib.walk(compiled, tokens, bitmask)
            per_token.append((time.perf_counter() - t0) * 1e6 / len(tokens))
        out[case] = {"compile_ms": round(compile_ms, 2), "tokens": len(tokens),
                     "mask_and_advance_us_per_token": round(statistics.median(per_token), 2)}
    t0 = time.perf_counter()
    lib.compile(BIG)
    out["big_schema_compile_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    return out


def bench_apply(vocab: int, device: str, rows: int) -> float:
    """Microseconds to apply a bitmask to `rows` of a 32-row batch (the others unconstrained)."""
    logits = torch.randn(32, vocab, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32).to(device)
    index = torch.arange(rows, device=device)
    for _ in range(3):
        apply_bitmask(logits, bitmask, index)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        apply_bitmask(logits, bitmask, index)
    if device == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e6 / 50, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/lora-serve-bench"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizers = {"demo": AutoTokenizer.from_pretrained(REPO_DEMO / "tiny" / "base"),
                  "128k": tokenizer_128k(args.cache)}
    results = {}
    for vocab_name, tokenizer in tokenizers.items():
        for name, cls in LIBRARIES.items():
            t0 = time.perf_counter()
            try:
                lib = cls(tokenizer)
            except ImportError as e:
                results.setdefault(name, {})["error"] = str(e)
                continue
            setup_ms = round((time.perf_counter() - t0) * 1e3, 1)
            results.setdefault(name, {})[vocab_name] = {"vocab": len(tokenizer), "tokenizer_setup_ms": setup_ms,
                                                        **bench_library(lib, tokenizer, args.rounds)}
            print(name, vocab_name, json.dumps(results[name][vocab_name]), flush=True)
    apply = {vocab_name: {f"{rows}_of_32_rows_us": bench_apply(len(tok), device, rows) for rows in (1, 8, 32)}
             for vocab_name, tok in tokenizers.items()}
    print("apply", apply)
    print(write_result("grammar-libs", {"libraries": results, "apply_bitmask": apply,
                                        "tokenizer_128k": tokenizer_128k.__doc__}))


if __name__ == "__main__":
    main()
