"""Structured output: `response_format` as a JSON grammar (xgrammar), applied to constrained rows as a token mask.

`apply_grammars` replaces this loop on the device, for the constrained rows only (a batch without one
is returned untouched, and a constrained row leaves its neighbours' logits as they were):

    for b in rows with a grammar: logits[b, t] = -inf   for every t that grammar[b] does not allow next

Each request's matcher (`Grammar`) fills its row of a [rows, ceil(V/32)] bitmask on the host and
advances by the sampled token in the engine. xgrammar was chosen by measurement
(bench/kernel/grammar.py, docs/benchmarks.md): at a 128k vocabulary it fills a row's mask and advances faster
than llguidance and outlines-core. Its price is compile time, long enough to stall steps, so the engine compiles
beside its loop
(`LLMEngine.compile_grammar`, called through `call_aside` before the request is added) and xgrammar
caches compiled grammars by their spec.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from urllib.parse import unquote

import torch

from app.errors import InvalidRequest

GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars xgrammar keeps, keyed by the spec


class InvalidResponseFormat(InvalidRequest):
    """A response_format whose schema cannot be compiled: a 400 naming the field, as OpenAI's errors do."""

    code = "invalid_response_format"

    def to_openai(self) -> dict:
        body = super().to_openai()
        body["error"]["param"] = "response_format"
        return body


def json_object_spec() -> str:
    return json.dumps({"type": "json_object"})


def json_schema_spec(schema: dict | bool) -> str:
    """The spec SamplingParams carries (JSON text, so it pickles and keys the cache). Keys keep their order:
    the properties' order is the output's."""
    return json.dumps({"type": "json_schema", "schema": schema}, separators=(",", ":"))


# Keywords xgrammar's JSON-schema converter accepts but does not enforce (its grammar lets violating output
# through, measured on xgrammar 0.2.8): a schema that uses one is refused rather than served unchecked.
UNENFORCED_KEYWORDS = {
    "multipleOf": "a number's divisor",
    "uniqueItems": "distinct array items",
    "oneOf": "exactly one matching branch (anyOf is enforced)",
    "not": "a negated schema",
    "if": "conditional schemas", "then": "conditional schemas", "else": "conditional schemas",
    "dependentRequired": "properties required by others", "dependentSchemas": "schemas applied by others",
    "maxContains": "an upper bound on matching items",
    "$dynamicRef": "dynamic references", "$recursiveRef": "dynamic references",
}
# Where a keyword's value holds subschemas: one, a list, or a name -> subschema map.
_SUBSCHEMA = {"items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedProperties", "unevaluatedItems"}
_SUBSCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def check_enforced(schema, path: str = "schema") -> None:
    """InvalidResponseFormat naming the first keyword the grammar would not enforce (and where it is)."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS or (key == "allOf" and isinstance(value, list) and len(value) > 1):
            what = UNENFORCED_KEYWORDS.get(key, "several schemas at once")
            raise InvalidResponseFormat(
                f"response_format.json_schema.{path} uses '{key}' ({what}), which structured output does not "
                "enforce; remove it or express it with the supported keywords"
            )
        if key in _SUBSCHEMA:
            check_enforced(value, f"{path}.{key}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                check_enforced(item, f"{path}.{key}[{i}]")
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, item in value.items():
                check_enforced(item, f"{path}.{key}.{name}")


def check_finite(schema) -> None:
    """InvalidResponseFormat if the schema has no finite instance: every way to build one needs another instance of
    itself, as {"$ref": "#"} does. xgrammar compiles such a schema into a grammar that allows no token, or none that
    can ever complete.

    Decided on the schema's reference graph (which subschemas an instance of each one must contain), not by asking
    a matcher whether any first token is allowed: an object whose required property refers back to it allows
    '{"a": {"a": ...' forever, so its first steps look fine."""
    alternatives, paths = _instance_graph(schema)
    finite: set[int] = set()
    changed = True
    while changed:  # the least fixpoint, children first (paths lists them after their parents): a tree takes one pass
        changed = False
        for key in reversed(paths):
            if key not in finite and any(all(id(d) in finite for d in alt) for alt in alternatives[key]):
                finite.add(key)
                changed = True
    if id(schema) not in finite:
        cycle = _cycle(schema, alternatives, finite, paths)
        raise InvalidResponseFormat(
            f"response_format.json_schema.schema has no finite instance: {cycle[-1]} refers only to itself "
            f"({' -> '.join(cycle)}); give the recursion a way to end, such as an optional property or an anyOf "
            "branch without the $ref")


def _instance_graph(schema) -> tuple[dict[int, list[list]], dict[int, str]]:
    """For each subschema an instance of `schema` may need (by id): its alternatives, each a list of the
    subschemas one of its instances must contain; and each one's path, in the order found."""
    alternatives, paths, todo = {}, {id(schema): "schema"}, [schema]
    while todo:
        node = todo.pop()
        alternatives[id(node)] = alts = _alternatives(node, schema)
        for dep, where in (need for alt in alts for need in alt):
            if id(dep) not in paths:  # a ref's path is whole; any other is relative to its parent's
                paths[id(dep)] = where if where.startswith("schema") else paths[id(node)] + where
                todo.append(dep)
    alternatives = {key: [[dep for dep, _ in alt] for alt in alts] for key, alts in alternatives.items()}
    return alternatives, paths


# The keywords from which xgrammar infers an object or an array where a schema names no type.
_TYPE_KEYWORDS = {"object": ("properties", "required"), "array": ("items", "prefixItems", "minItems")}


def _alternatives(node, root) -> list[list[tuple[dict, str]]]:
    """The ways to build an instance of node, in the order xgrammar's converter reads a schema: a $ref replaces its
    siblings, anyOf and allOf come before type. Each way lists the (subschema, path) its instances contain. Anything
    else (a leaf, a boolean schema, a $ref this check cannot follow) counts as finite: xgrammar reports what it
    cannot compile."""
    if not isinstance(node, dict):
        return [[]]
    if isinstance(node.get("$ref"), str):
        return [_needs(*_resolve(root, node["$ref"]))]
    if "const" in node or "enum" in node:
        return [[]]
    if isinstance(node.get("anyOf"), list):
        return [_needs(s, f".anyOf[{i}]") for i, s in enumerate(node["anyOf"])] or [[]]
    if isinstance(node.get("allOf"), list):
        return [[need for i, s in enumerate(node["allOf"]) for need in _needs(s, f".allOf[{i}]")]]
    inferred = [t for t, keys in _TYPE_KEYWORDS.items() if any(k in node for k in keys)]
    types = node.get("type", inferred or None)
    types = [types] if isinstance(types, str) or types is None else types
    return [_contents(node, t) for t in types] or [[]]


def _contents(node: dict, type_) -> list[tuple[dict, str]]:
    """What every instance of node of this type contains: its required properties, or an array's first minItems
    items."""
    if type_ == "object" and isinstance(node.get("properties"), dict) and isinstance(node.get("required"), list):
        properties = node["properties"]
        return [need for name in node["required"] if isinstance(name, str)
                for need in _needs(properties.get(name), f".properties.{name}")]
    if type_ == "array" and isinstance(node.get("minItems"), int):
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        needed = [need for i, s in enumerate(prefix[:node["minItems"]]) for need in _needs(s, f".prefixItems[{i}]")]
        return needed + (_needs(node.get("items"), ".items") if node["minItems"] > len(prefix) else [])
    return []


def _needs(subschema, where: str) -> list[tuple[dict, str]]:
    return [(subschema, where)] if isinstance(subschema, dict) else []


def _resolve(root, ref: str) -> tuple[object, str]:
    """The subschema a local $ref (a JSON pointer) names, and its path; None for any other reference."""
    if ref != "#" and not ref.startswith("#/"):
        return None, ""
    node, where = root, "schema"
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node, where = node[int(token)], f"{where}[{token}]"
        elif isinstance(node, dict) and token in node:
            node, where = node[token], f"{where}.{token}"
        else:
            return None, ""
    return node, where


def _cycle(schema, alternatives, finite: set[int], paths) -> list[str]:
    """Paths from the root along subschemas with no finite instance, up to the first one seen twice."""
    seen, node_id = [], id(schema)
    while node_id not in seen:
        seen.append(node_id)
        alt = alternatives[node_id][0]
        node_id = next(id(d) for d in alt if id(d) not in finite)
    return [paths[k] for k in seen[seen.index(node_id):]] + [paths[node_id]]


class GrammarCompiler:
    """Compiles response_format specs for one tokenizer; thread-safe, so it runs beside the engine loop."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._lock = threading.Lock()
        self._compiler = None  # built on first use: xgrammar's import and tokenizer scan are slow

    def compile(self, spec: str):
        """xgrammar's CompiledGrammar for spec (cached); InvalidResponseFormat if the schema does not compile."""
        compiler = self._xgrammar_compiler()
        request = json.loads(spec)
        # Compact separators and no free whitespace: a grammar that allows whitespace runs lets a weak
        # model pad forever; these still parse as JSON.
        try:
            if request["type"] == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            check_enforced(request["schema"])
            check_finite(request["schema"])
            return compiler.compile_json_schema(json.dumps(request["schema"]), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            first_line = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidResponseFormat(f"response_format.json_schema.schema cannot be compiled: "
                                        f"{first_line.split(': ', 1)[-1]}") from e

    def grammar(self, spec: str) -> Grammar:
        return Grammar(self.compile(spec), self._vocab_size, self._stop_ids)

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler


class Grammar:
    """One request's matcher: which tokens may come next, and the sampled token fed back."""

    def __init__(self, compiled, vocab_size: int, stop_ids: Sequence[int]):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._vocab_size = vocab_size
        self._stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        # The last fill allowed no token: the row's logits are all -inf, so whatever it samples breaks the
        # grammar. Read by the engine, which ends the request instead (app/engine/outputs.py).
        self.is_dead_end = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] ([rows, ceil(V/32)] int32 on the host)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.is_dead_end = not bool(bitmask[row].any())  # on the host already: no sync

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar refuses it (the mask lets no such token through)."""
        return self._matcher.accept_token(token)

    @property
    def is_finished(self) -> bool:
        """The output is complete: only a stop token could follow (or one already did).

        The request ends here with "stop", so no EOS has to be sampled (ignore_eos and min_tokens
        cannot keep a finished grammar going)."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        bitmask = torch.zeros(1, (self._vocab_size + 31) // 32, dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = unpack(bitmask, self._vocab_size)[0]
        return int(allowed.sum()) == int(allowed[self._stop_ids].sum())


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 -> [rows, V] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # bit j of word w is token 32 * w + j
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the disallowed tokens of rows [R] at -inf (bitmask [R, ceil(V/32)] on the device).

    Out of place: the raw logits stay as they were for logprobs."""
    masked = logits[rows].masked_fill(~unpack(bitmask, logits.shape[1]), float("-inf"))
    return logits.index_put((rows,), masked)


def apply_grammars(logits: torch.Tensor, requests: Sequence) -> torch.Tensor:
    """The batch's logits with each constrained row masked to its grammar; the input itself when none is."""
    rows = [i for i, r in enumerate(requests) if getattr(r, "grammar", None) is not None]
    if not rows:
        return logits
    device = logits.device
    bitmask = torch.zeros(len(rows), (logits.shape[1] + 31) // 32, dtype=torch.int32)  # [rows, words]
    for j, i in enumerate(rows):
        requests[i].grammar.fill(bitmask, j)
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return apply_bitmask(logits, bitmask.to(device, non_blocking=True), index)
