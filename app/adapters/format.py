"""Reading and checking PEFT adapter files: the config (parsed by PEFT) and the LoRA tensors.

Pure functions used by the registry at registration and again at load time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.errors import (
    AdapterConfigMismatch,
    AdapterFormatError,
    AdapterInvalid,
    AdapterShapeMismatch,
    AdapterTargetUnsupported,
)
from app.adapters.patterns import pattern_value, selected_modules
from app.adapters.safetensors_file import WEIGHTS_NAME, AdapterFile, StoredTensor, check_values_finite, read_adapter_file

if TYPE_CHECKING:  # peft (a second or more of imports) is imported where a config is read
    from peft import LoraConfig

CONFIG_NAME = "adapter_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")

# PEFT saves `base_model.model.<module>.<rest>`; `rest` starts at the first lora_* or base_layer segment.
_TENSOR_KEY_RE = re.compile(r"base_model\.model\.(?P<module>.+?)\.(?P<rest>(?:lora_|base_layer).*)")
_SERVED_PARTS = {"lora_A.weight": "A", "lora_B.weight": "B"}

# LoraConfig fields whose truthy value changes the forward pass in ways our batched kernel does not compute.
_UNSERVED_FEATURES = (
    ("use_dora", "DoRA (use_dora)", AdapterInvalid),
    ("lora_bias", "a bias on lora_B (lora_bias)", AdapterInvalid),
    ("fan_in_fan_out", "transposed weights (fan_in_fan_out)", AdapterInvalid),
    ("layer_replication", "layer_replication", AdapterInvalid),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)", AdapterInvalid),
    ("use_qalora", "QA-LoRA (use_qalora)", AdapterInvalid),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)", AdapterInvalid),
    ("megatron_config", "Megatron parallel layers (megatron_config)", AdapterInvalid),
    ("modules_to_save", "fully trained extra modules (modules_to_save)", AdapterTargetUnsupported),
    ("target_parameters", "LoRA on raw parameters (target_parameters)", AdapterTargetUnsupported),
    ("trainable_token_indices", "trainable token embeddings (trainable_token_indices)", AdapterTargetUnsupported),
)
# These inits rewrite the base weights, so the adapter is only right on top of its own residual base model.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def read_config(adapter_id: str, config_file: Path) -> LoraConfig:
    """Parse with PEFT from the local file only (never the Hub), then refuse what we do not serve."""
    try:
        from peft import LoraConfig

        raw = LoraConfig.from_json_file(str(config_file))
        if not isinstance(raw, dict):
            raise ValueError("top level is not a JSON object")
        if raw.get("peft_type") != "LORA":
            raise AdapterInvalid(
                f"adapter '{adapter_id}': peft_type is {raw.get('peft_type')!r}; only 'LORA' adapters are served"
            )
        config = LoraConfig.from_peft_type(**raw)  # drops keys from newer PEFT versions, with a warning
    except RecursionError as e:
        raise AdapterFormatError(f"adapter '{adapter_id}': {CONFIG_NAME} nests too deeply to be a LoRA config") from e
    except UnicodeDecodeError as e:  # its message quotes the byte
        raise AdapterFormatError(f"adapter '{adapter_id}': {CONFIG_NAME} is not UTF-8 text") from e
    except (OSError, ValueError, TypeError) as e:
        raise AdapterFormatError(f"adapter '{adapter_id}': {CONFIG_NAME} is not a valid LoRA config: {e}") from e
    for field, feature, error in _UNSERVED_FEATURES:
        if getattr(config, field, None):
            raise error(f"adapter '{adapter_id}': {feature} is not served; retrain or merge without it")
    if config.bias != "none":
        raise AdapterInvalid(f"adapter '{adapter_id}': bias={config.bias!r} trains base biases; only 'none' is served")
    init = str(config.init_lora_weights).lower()
    if init.startswith(_BASE_MODIFYING_INITS):
        raise AdapterInvalid(
            f"adapter '{adapter_id}': init_lora_weights={config.init_lora_weights!r} modifies the base weights; "
            "save it with save_pretrained(..., path_initial_model_for_weight_conversion=...) to make a plain LoRA"
        )
    return config


# The kernels take these; other floats (float8) would need scales PEFT does not store, and torch has no isfinite for them.
_SERVED_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def read_modules(
    adapter_id: str,
    weights_file: Path,
    supported_targets: frozenset[str],
    base_shapes: Mapping[str, tuple[int, int]],
    num_layers: int | None,
    check_finite: bool = True,
) -> tuple[AdapterFile, dict[str, tuple[str, str]]]:
    """The file read whole and module path -> (key of A [r, in], key of B [out, r]), after checking keys,
    targets, shapes and (check_finite) that every value is finite. OSError passes through."""
    file = read_adapter_file(adapter_id, weights_file)
    modules = check_modules(adapter_id, file.entries, supported_targets, base_shapes, num_layers)
    if check_finite:
        for key in sorted(file.entries):
            check_values_finite(adapter_id, key, file.flat(key))
    return file, modules


def check_modules(
    adapter_id: str,
    entries: Mapping[str, StoredTensor],
    supported_targets: frozenset[str],
    base_shapes: Mapping[str, tuple[int, int]],
    num_layers: int | None,
) -> dict[str, tuple[str, str]]:
    """module path -> (key of A [r, in], key of B [out, r]), from the header alone: keys, targets, dtypes, shapes."""
    if not entries:
        raise AdapterFormatError(f"adapter '{adapter_id}': {WEIGHTS_NAME} holds no tensors")

    module_to_parts: dict[str, dict[str, str]] = {}
    for key, entry in sorted(entries.items()):
        match = _TENSOR_KEY_RE.fullmatch(key)
        if match is None:
            raise AdapterFormatError(
                f"adapter '{adapter_id}': unexpected tensor {key!r}; expected "
                "'base_model.model.<module>.lora_A.weight' and '.lora_B.weight'"
            )
        module, rest = match["module"], match["rest"]
        if short_name(module) not in supported_targets:
            raise AdapterTargetUnsupported(
                f"adapter '{adapter_id}': tensor {key!r} targets {module}; "
                f"supported targets are {sorted(supported_targets)}"
            )
        if module not in base_shapes:
            layers = f" (it has {num_layers} layers)" if num_layers is not None else ""
            raise AdapterShapeMismatch(f"adapter '{adapter_id}': the base model has no module {module}{layers}")
        if rest not in _SERVED_PARTS:
            raise AdapterFormatError(
                f"adapter '{adapter_id}': unexpected tensor {key!r}; only lora_A.weight and lora_B.weight are served"
            )
        if entry.dtype not in _SERVED_DTYPES:
            raise AdapterFormatError(
                f"adapter '{adapter_id}': tensor {key!r} has dtype {entry.dtype}; adapters are served from "
                "float32, float16 or bfloat16 weights"
            )
        module_to_parts.setdefault(module, {})[_SERVED_PARTS[rest]] = key

    modules = {}
    for module, parts in module_to_parts.items():
        if len(parts) != 2:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise AdapterFormatError(f"adapter '{adapter_id}': module {module} has no {missing}.weight tensor")
        a, b = entries[parts["A"]], entries[parts["B"]]
        in_features, out_features = base_shapes[module]
        r = a.shape[0] if a.ndim == 2 else -1
        if r < 1 or tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise AdapterShapeMismatch(
                f"adapter '{adapter_id}': module {module} expects lora_A [r, {in_features}] and "
                f"lora_B [{out_features}, r], got {list(a.shape)} and {list(b.shape)} "
                "(was the adapter trained on a different base model?)"
            )
        modules[module] = (parts["A"], parts["B"])
    return modules


def check_config_matches(
    adapter_id: str,
    config: LoraConfig,
    module_ranks: Mapping[str, int],
    base_shapes: Mapping[str, tuple[int, int]],
) -> dict[str, float]:
    """Check that the config describes the tensors (ranks, targets); return module path -> scale as PEFT computes it."""
    selected = selected_modules(adapter_id, config, base_shapes)
    untargeted = sorted(set(module_ranks) - selected)
    if untargeted:
        raise AdapterConfigMismatch(
            f"adapter '{adapter_id}': {len(untargeted)} modules have tensors but target_modules="
            f"{_targets_text(config)} does not select them, e.g. {untargeted[:3]}"
        )
    without_tensors = sorted(selected - set(module_ranks))
    if without_tensors:
        raise AdapterConfigMismatch(
            f"adapter '{adapter_id}': target_modules={_targets_text(config)} selects {len(without_tensors)} "
            f"modules of the base model that have no tensors, e.g. {without_tensors[:3]}"
        )
    rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
    module_scales = {}
    for module, tensor_rank in module_ranks.items():
        # The lookup peft.tuners.lora.LoraModel._create_and_replace makes (app/adapters/patterns.py).
        r = pattern_value(adapter_id, "rank_pattern", rank_pattern, module, config.r)
        alpha = pattern_value(adapter_id, "alpha_pattern", alpha_pattern, module, config.lora_alpha)
        if tensor_rank != r:
            raise AdapterConfigMismatch(
                f"adapter '{adapter_id}': module {module} has rank {tensor_rank} in its tensors but {r} in "
                f"{CONFIG_NAME} (r / rank_pattern)"
            )
        module_scales[module] = _scale(adapter_id, module, alpha, r, config.use_rslora)
    return module_scales


# |lora_alpha / r| past this makes the LoRA term swamp the base model's activations (and overflow in bf16);
# no trained adapter comes near it, so a larger scale is a broken or hostile config.
MAX_LORA_SCALE = 1e4


def _scale(adapter_id: str, module: str, alpha, r: int, use_rslora: bool) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterInvalid(f"adapter '{adapter_id}': lora_alpha for {module} is {alpha!r}, not a number")
    scale = alpha / math.sqrt(r) if use_rslora else alpha / r
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise AdapterInvalid(
            f"adapter '{adapter_id}': lora_alpha {alpha!r} with r {r} scales {module} by {scale!r}; "
            f"a finite scale of at most {MAX_LORA_SCALE:g} in magnitude is served"
        )
    return float(scale)


def _targets_text(config: LoraConfig) -> str:
    targets = config.target_modules
    return repr(targets) if isinstance(targets, str) else repr(sorted(targets or ()))
