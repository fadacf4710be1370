"""FP8 checkpoints as they are published: compressed-tensors' float format (`quant_method: compressed-tensors`,
`format: float-quantized`), which RedHatAI and Neural Magic publish and vLLM serves: each linear's weight in
float8_e4m3fn with a `weight_scale` per output channel or per tensor, activations quantized per token at run
time. The engine serves their FP8 weights as they are (app/model/fp8.py), without quantizing them again.

Any other `quantization_config` (other methods, static activation scales, block-scaled weights) is refused by
name, as the start-up check refuses every feature the engine does not compute exactly.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from app.model.fp8 import FP8, Fp8Linear, Fp8Weight

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Fp8Scheme:
    """What a served FP8 checkpoint declares."""

    weight_strategy: str  # "channel" (a scale per output channel) or "tensor" (one scale per weight)
    ignore: tuple[str, ...]  # modules left unquantized: names, or "re:<pattern>"

    def quantized(self, path: str) -> bool:
        return not any(re.fullmatch(rule[3:], path) if rule.startswith("re:") else rule == path
                       for rule in self.ignore)


def quantization_config(config) -> dict | None:
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def fp8_scheme(config) -> tuple[Fp8Scheme | None, str | None]:
    """(the FP8 scheme of a checkpoint the engine serves, None) or (None, why it is refused); (None, None) for a
    checkpoint with no quantization_config."""
    qc = quantization_config(config)
    if qc is None:
        return None, None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        return None, (f"quantized weights (quant_method {method!r}); served are dense weights and compressed-tensors' "
                      "FP8 float format (float-quantized, per-channel or per-tensor weight scales, dynamic "
                      "per-token activations)")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None, f"{len(groups)} compressed-tensors config groups; served is one, over every Linear"
    form = qc.get("format") or groups[0].get("format")
    if form != "float-quantized":
        return None, f"compressed-tensors format {form!r}; served is 'float-quantized' (FP8)"
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if (weights.get("type"), weights.get("num_bits"), weights.get("dynamic", False)) != ("float", 8, False) \
            or weights.get("strategy") not in ("channel", "tensor") or not weights.get("symmetric", True):
        return None, (f"compressed-tensors weights {_brief(weights)}; served are symmetric static FP8 weights with "
                      "a scale per channel or per tensor")
    if inputs is not None and ((inputs.get("type"), inputs.get("num_bits"), inputs.get("dynamic")) != ("float", 8, True)
                               or inputs.get("strategy") != "token"):
        return None, (f"compressed-tensors input activations {_brief(inputs)}; served are dynamic per-token FP8 "
                      "activations")
    if "Linear" not in (groups[0].get("targets") or []):
        return None, f"compressed-tensors targets {groups[0].get('targets')}; served is 'Linear'"
    return Fp8Scheme(weights["strategy"], tuple(qc.get("ignore") or ())), None


def _brief(args: dict) -> str:
    keys = ("type", "num_bits", "strategy", "dynamic", "symmetric", "block_structure", "group_size")
    return "(" + ", ".join(f"{k}={args[k]}" for k in keys if args.get(k) is not None) + ")"


def dense_config(config):
    """The config without its quantization_config: what transformers builds the (dense) model from, before the
    FP8 linears replace its projections."""
    config = type(config).from_dict(config.to_dict())
    del config.quantization_config
    return config


def load_fp8_linears(model: nn.Module, folder: Path, paths, scheme: Fp8Scheme) -> int:
    """Each projection at `paths` that the scheme quantizes becomes an Fp8Linear of the checkpoint's own FP8 weight
    and scale, on the model's device; returns how many."""
    files = tensor_files(Path(folder))
    count = 0
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(safe_open(file, "pt")) for file in set(files.values())}

        def read(name: str) -> torch.Tensor:
            if name not in files:
                raise ValueError(f"the checkpoint has no tensor {name}")
            return opened[files[name]].get_tensor(name)

        for path in paths:
            if not scheme.quantized(path):
                continue
            dense = model.get_submodule(path)
            q, scale = read(f"{path}.weight"), read(f"{path}.weight_scale").float().flatten()
            if q.dtype != FP8 or q.shape != dense.weight.shape:
                raise ValueError(f"{path}.weight is {q.dtype} {list(q.shape)}; float8_e4m3fn "
                                 f"{list(dense.weight.shape)} was expected")
            if scale.numel() not in (1, q.shape[0]):
                raise ValueError(f"{path}.weight_scale has {scale.numel()} values; 1 or {q.shape[0]} were expected")
            device = dense.weight.device
            weight = Fp8Weight(q.to(device), scale.expand(q.shape[0]).contiguous().to(device))
            model.set_submodule(path, Fp8Linear(weight, dense.bias))
            count += 1
    return count


def tensor_files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(folder / WEIGHTS_FILE, "pt") as f:
        return dict.fromkeys(f.keys(), folder / WEIGHTS_FILE)
