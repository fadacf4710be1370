"""FP8 checkpoints in compressed-tensors' float format, written by the compressed-tensors package from a dense
model folder, as llm-compressor writes the ones RedHatAI publishes (without calibration: FP8 weights need none); and
the FP8 engine's reference: the FP8 base under PEFT's adapter arithmetic."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.adapters.targets import target_shapes
from app.model.architectures import check_supported
from app.model.fp8 import FP8_MAX, Fp8Weight, fp8_linear_reference
from app.model.tensor_parallel import ShardPlan, TensorParallel


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
    if (dense / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(dense).save_pretrained(out)
    return out


def ranks_fp8_linear(x: torch.Tensor, parts, bias: torch.Tensor | None) -> torch.Tensor:
    """A projection in FP8 as its tensor-parallel ranks compute it, in float32: each rank's input columns times its
    FP8 weight (its activation quantized per token on its own), the products summed, then the bias. parts: each
    rank's (input columns, Fp8Weight); one part (slice(None), the whole weight) is the unsharded projection."""
    y = sum(fp8_linear_reference(x[..., index], weight) for index, weight in parts)
    return y if bias is None else y + bias.float()


def fp8_peft_model(root: Path, adapter: str | None, ranks: int = 1, device: str = "cuda",
                   dtype: torch.dtype = torch.bfloat16):
    """The FP8 base through PEFT's adapter arithmetic: each projection's base output is fp8_linear_reference's,
    computed from its input as the engine's GEMM sees it, and PEFT adds the adapter's from the same input. With
    `ranks`, as that many tensor-parallel ranks compute it: a row-parallel projection's ranks quantize their input
    columns (weight and activation) on their own, and their products are summed."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=dtype).to(device)
    arch = check_supported(model.config)
    plans = [ShardPlan(arch, model.config, TensorParallel(rank, ranks)) for rank in range(ranks)] if ranks > 1 else []
    for path in target_shapes(model.config):
        linear = model.get_submodule(path)
        if not plans or plans[0].splits[path].kind == "column":  # a column-parallel shard's scales are the whole's
            parts = [(slice(None), Fp8Weight.quantize(linear.weight))]
        else:
            indices = [plan.splits[path].index.to(device) for plan in plans]
            parts = [(index, Fp8Weight.quantize(linear.weight[:, index])) for index in indices]
        linear.register_forward_hook(lambda module, args, out, parts=parts:
                                     ranks_fp8_linear(args[0].float(), parts, module.bias).to(out.dtype))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, root / "adapters" / adapter)
    return model.eval()


def fp8_peft_reference(root: Path, adapter: str | None, prompt: str, max_new: int, ranks: int = 1):
    """`fp8_peft_model`'s greedy tokens for the prompt on the GPU, in bf16, and each step's scores."""
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    model = fp8_peft_model(root, adapter, ranks)
    inputs = tokenizer(prompt, return_tensors="pt").to("cuda")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [s[0].float().cpu() for s in out.scores]
