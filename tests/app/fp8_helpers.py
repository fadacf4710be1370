"""FP8 checkpoints in compressed-tensors' float format, written by the compressed-tensors package from a dense
model folder, as llm-compressor writes the ones RedHatAI publishes (without calibration: FP8 weights need none)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.model.fp8 import FP8_MAX


def write_fp8_checkpoint(dense: Path, out: Path, strategy: str = "channel") -> Path:
    """`dense` as an FP8 checkpoint at `out`: every Linear but lm_head in float8_e4m3fn with a scale per output
    channel ("channel") or per weight ("tensor"), activations dynamic per token."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                  apply_quantization_config)

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        format="float-quantized"))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                weight = module.weight.abs()
                amax = weight.amax(dim=1) if strategy == "channel" else weight.amax()
                module.weight_scale.copy_((amax * (1 / FP8_MAX)).reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(dense).save_pretrained(out)
    return out
