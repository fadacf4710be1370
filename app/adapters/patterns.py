"""Which base modules an adapter config selects, and its per-module rank and alpha, with PEFT's rules.

PEFT evaluates `target_modules`, `exclude_modules`, `layers_pattern` and the keys of `rank_pattern` and
`alpha_pattern` as regular expressions with Python's `re`, which cannot be interrupted: one pattern with
nested repetition (`(.|.){23}y|...`) backtracks for seconds per module and freezes the process that
registers the adapter. The config comes from a client, so these rules are written again here on the
`regex` package, whose matches take a timeout. The semantics are PEFT's (peft.tuners.tuners_utils.
check_target_module_exists and peft.utils.other.get_pattern_key); tests/app/adapters/test_patterns.py
compares the two on ordinary configs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import regex

from app.errors import AdapterInvalid

if TYPE_CHECKING:
    from peft import LoraConfig

# A benign pattern matches a module name in microseconds; this bounds a hostile one per module.
MATCH_TIMEOUT_S = 0.05


def _match(adapter_id: str, field: str, pattern: str, name: str, full: bool) -> bool:
    try:
        compiled = regex.compile(pattern)
        found = (compiled.fullmatch if full else compiled.match)(name, timeout=MATCH_TIMEOUT_S)
    except TimeoutError as e:
        raise AdapterInvalid(
            f"adapter '{adapter_id}': {field} pattern {pattern!r} took over {MATCH_TIMEOUT_S * 1e3:.0f} ms to match "
            f"one module name; simplify it (nested repetition backtracks exponentially)"
        ) from e
    except (regex.error, TypeError, RecursionError) as e:
        raise AdapterInvalid(f"adapter '{adapter_id}': {field} {pattern!r} is not a valid regular expression: {e}") from e
    return found is not None


def _layer_index(adapter_id: str, config: LoraConfig, module: str) -> int | None:
    patterns = config.layers_pattern
    if not patterns:
        # The first numbered segment is the layer index (not a nested one such as an expert's).
        candidates = [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    else:
        candidates = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in ([patterns] if isinstance(patterns, str) else patterns)]
    for pattern in candidates:
        try:
            found = regex.match(pattern, module, timeout=MATCH_TIMEOUT_S)
        except TimeoutError as e:
            raise AdapterInvalid(f"adapter '{adapter_id}': layers_pattern {patterns!r} takes too long to match") from e
        except (regex.error, TypeError) as e:
            raise AdapterInvalid(f"adapter '{adapter_id}': layers_pattern {patterns!r} is not valid: {e}") from e
        if found is not None:
            return int(found["idx"])
    return None


def selects(adapter_id: str, config: LoraConfig, module: str) -> bool:
    """Whether `config` puts LoRA on the base module `module`, as PEFT decides."""
    excluded = config.exclude_modules
    if excluded:
        if isinstance(excluded, str):
            if _match(adapter_id, "exclude_modules", excluded, module, full=True):
                return False
        elif module in excluded or any(module.endswith(f".{key}") for key in excluded):
            return False
    targets = config.target_modules
    if targets is None:
        return False
    if isinstance(targets, str):
        return _match(adapter_id, "target_modules", targets, module, full=True)
    if module in targets:
        return True
    if not any(module.endswith(f".{key}") for key in targets):
        return False
    layers = config.layers_to_transform
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(adapter_id, config, module)
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def selected_modules(adapter_id: str, config: LoraConfig, modules: Iterable[str]) -> set[str]:
    return {module for module in modules if selects(adapter_id, config, module)}


def pattern_value(adapter_id: str, field: str, patterns: Mapping[str, object], module: str, default):
    """The value of the first key of `patterns` (rank_pattern or alpha_pattern) that names `module`, else default."""
    for key in patterns:
        if _match(adapter_id, field, rf"(.*\.)?({key})$", module, full=False):
            return patterns[key]
    return default
