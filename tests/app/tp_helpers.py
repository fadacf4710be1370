"""The workers of the tensor-parallel tests: each process of a gloo group builds the same random model and a PEFT
adapter on it, computes the unsharded logits (the reference), then shards the model for its rank, serves the
adapter through the LoRA layers from its shard of the adapter, and computes the logits again: one batch, a base row
and an adapter row."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from app.adapters.targets import target_shapes
from app.engine.workers import shard_parts
from app.model.architectures import check_supported
from app.model.fp8 import Fp8Linear, Fp8Weight, quantize_linears
from app.model.fp8_checkpoint import fp8_scheme, load_fp8_linears
from app.model.lora import LoRAMetadata, LoRASlots, segments
from app.model.tensor_parallel import ShardPlan, TensorParallel, load_shard, shard_model
from arch_helpers import case_config
from fp8_helpers import ranks_fp8_linear, write_fp8_checkpoint
from prefetch.layout import PageLayout

RANK, ALPHA, PROMPT = 4, 8, 7


def build(name: str, overrides: dict):
    """The same model and PEFT adapter on every rank (same seeds), in float32."""
    config = case_config(name, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases start constant: make them count
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    arch = check_supported(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                              target_modules=list(arch.target_names)))
    with torch.no_grad():
        for param_name, param in peft.named_parameters():
            if "lora_B" in param_name:
                param.normal_(std=0.1)
    adapter = {path: (peft.get_submodule(f"base_model.model.{path}").lora_A["default"].weight.detach(),
                      peft.get_submodule(f"base_model.model.{path}").lora_B["default"].weight.detach())
               for path in arch.target_shapes(config)}
    return model, peft.eval(), adapter, arch


def logits_errors(name: str, overrides: dict, tp: TensorParallel, how: str, folder: Path) -> dict:
    """Largest differences from the unsharded logits: the base row against the base model, the adapter row
    against PEFT. `how` the rank gets its shard: "shard" shards the whole model (shard_model), "checkpoint" reads
    its shard from the model `save_checkpoints` saved in `folder` (load_shard), "fp8" shards the whole model and
    quantizes the shard as `quantization: fp8` does, "fp8-checkpoint" reads its shard of the model saved as an FP8
    checkpoint; the FP8
    ones against the unsharded model in the FP8 arithmetic of the ranks (fp8_reference), both through our LoRA
    layers, since PEFT does not wrap FP8 linears."""
    model, peft, adapter, arch = build(name, overrides)
    ids = torch.randint(3, 1000, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits, peft_logits = model(ids).logits, peft(ids).logits
    if how == "fp8":
        base_logits, peft_logits = fp8_reference(copy.deepcopy(model), arch, tp.size, adapter, ids)
    elif how == "fp8-checkpoint":
        base_logits, peft_logits = fp8_reference(copy.deepcopy(model), arch, tp.size, adapter, ids, folder / "fp8")
    if how in ("checkpoint", "fp8-checkpoint"):
        saved = folder / ("dense" if how == "checkpoint" else "fp8")
        config = model.config if how == "checkpoint" else AutoConfig.from_pretrained(saved)  # with its FP8 scheme
        model, plan = load_shard(saved, config, arch, tp, torch.float32, torch.device("cpu"))
        model.config._attn_implementation = "eager"
    else:
        plan = shard_model(model, arch, tp)
    if how == "fp8":
        quantize_linears(model, arch.target_shapes(model.config))
    got = lora_logits(model, plan, adapter, ids)
    return {"base": (got[0] - base_logits[0]).abs().max().item(),
            "adapter": (got[1] - peft_logits[1]).abs().max().item(),
            "adapter_effect": (peft_logits[1] - base_logits[1]).abs().max().item(),
            "local_heads": model.config.num_attention_heads}


class SplitRowFp8(nn.Module):
    """A row-parallel projection in FP8 as its ranks compute it, in one process (ranks_fp8_linear)."""

    def __init__(self, parts: list[tuple[torch.Tensor, Fp8Weight]], bias: torch.Tensor | None):
        super().__init__()
        self.parts, self.bias = parts, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ranks_fp8_linear(x, self.parts, self.bias)


def fp8_reference(model, arch, size: int, adapter: dict, ids: torch.Tensor,
                  checkpoint: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the whole model in the FP8 arithmetic of `size` ranks, with the adapter in float32 beside each
    projection: the base model's and the adapter's (each row of `ids`). The FP8 weights are the checkpoint's, or
    else quantized as `quantize_linears` quantizes a rank's shard: a column-parallel one as the whole, a
    row-parallel one over each rank's input columns."""
    paths = arch.target_shapes(model.config)
    if checkpoint is not None:
        load_fp8_linears(model, checkpoint, paths, fp8_scheme(AutoConfig.from_pretrained(checkpoint))[0])
    plans = [ShardPlan(arch, model.config, TensorParallel(rank, size)) for rank in range(size)]
    for path, split in plans[0].splits.items():
        linear = model.get_submodule(path)
        whole = linear.fp8 if isinstance(linear, Fp8Linear) else None
        if split.kind == "column":
            if whole is None:
                model.set_submodule(path, Fp8Linear.from_linear(linear))
            continue
        indices = [plan.splits[path].index for plan in plans]
        parts = [(index, Fp8Weight(whole.q[:, index], whole.scale) if whole is not None
                  else Fp8Weight.quantize(linear.weight[:, index])) for index in indices]
        model.set_submodule(path, SplitRowFp8(parts, linear.bias))
    with torch.no_grad():
        base = model(ids).logits
        for path, (a, b) in adapter.items():
            model.get_submodule(path).register_forward_hook(
                lambda module, args, out, a=a, b=b: out + ALPHA / RANK * (args[0] @ a.T) @ b.T)
        return base, model(ids).logits


def lora_logits(model, plan, adapter: dict, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits through our LoRA layers, the adapter (its shard, with a plan) on the second row."""
    layout = PageLayout(target_shapes(model.config), max_rank=RANK, page_rows=RANK)
    lora = LoRASlots(model, layout, num_pages=2, num_slots=1, t_cap=2 * PROMPT)
    parts = {path: (a.flatten(), b.flatten(), RANK, ALPHA / RANK) for path, (a, b) in adapter.items()}
    if plan is not None:
        parts = shard_parts(plan, parts)
    host = [torch.empty(layout.page_numel)]
    lora.write_slot(0, [0], host, layout.pack(parts, host), RANK)
    order, starts, slots = segments([-1] * PROMPT + [0] * PROMPT, 2 * PROMPT, 2 * PROMPT)
    lora.ctx.meta = LoRAMetadata(*(torch.tensor(v, dtype=torch.int32) for v in (order, starts, slots)))
    with torch.no_grad():
        return model(ids).logits


def save_checkpoints(cases: list, out: str) -> None:
    """The checkpoints the cases read, saved before the workers start (compressed-tensors' writer runs collectives
    of its own where a process group exists): the model each rank builds, dense, and for "fp8-checkpoint" also in
    compressed-tensors' FP8 format."""
    for case, name, overrides, how in cases:
        if how in ("checkpoint", "fp8-checkpoint"):
            folder = Path(f"{out}-{case}")
            build(name, overrides)[0].save_pretrained(folder / "dense")
            if how == "fp8-checkpoint":
                write_fp8_checkpoint(folder / "dense", folder / "fp8")


def worker(rank: int, size: int, init_file: str, cases: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        results = {case: logits_errors(name, overrides, tp, how, Path(f"{out}-{case}"))
                   for case, name, overrides, how in cases}
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
