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
from transformers import AutoModelForCausalLM

from app.adapters.targets import target_shapes
from app.engine.workers import shard_parts
from app.model.architectures import check_supported
from app.model.fp8 import Fp8Linear, Fp8Weight, fp8_linear_reference, quantize_linears
from app.model.lora import LoRAMetadata, LoRASlots, segments
from app.model.tensor_parallel import ShardPlan, TensorParallel, load_shard, shard_model
from arch_helpers import case_config
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
    its shard from the model saved in `folder` (load_shard), "fp8" shards the whole model and quantizes the shard
    as `quantization: fp8` does, against the unsharded model quantized the same way (both through our LoRA layers,
    since PEFT does not wrap FP8 linears)."""
    model, peft, adapter, arch = build(name, overrides)
    ids = torch.randint(3, 1000, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits, peft_logits = model(ids).logits, peft(ids).logits
    if how == "fp8":
        base_logits, peft_logits = fp8_reference(copy.deepcopy(model), arch, tp.size, adapter, ids)
    if how == "checkpoint":
        if tp.rank == 0:  # every rank built the same model; transformers saves on rank 0 alone
            model.save_pretrained(folder)
        dist.barrier()
        model, plan = load_shard(folder, model.config, arch, tp, torch.float32, torch.device("cpu"))
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
    """A row-parallel projection in FP8 as `size` ranks compute it, in one process: each rank's input columns
    quantized on their own (the weight per output channel, the activation per token), the products summed, then
    the bias."""

    def __init__(self, linear: nn.Linear, indices: list[torch.Tensor]):
        super().__init__()
        self.parts = [(index, Fp8Weight.quantize(linear.weight[:, index])) for index in indices]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = sum(fp8_linear_reference(x[..., index], weight) for index, weight in self.parts)
        return y if self.bias is None else y + self.bias


def fp8_reference(model, arch, size: int, adapter: dict, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the whole model in the FP8 arithmetic of `size` ranks (column-parallel projections as
    `quantize_linears` makes them, row-parallel ones as SplitRowFp8), with the adapter in float32 beside each
    projection: the base model's and the adapter's (each row of `ids`)."""
    plans = [ShardPlan(arch, model.config, TensorParallel(rank, size)) for rank in range(size)]
    for path, split in plans[0].splits.items():
        linear = model.get_submodule(path)
        if split.kind == "column":
            model.set_submodule(path, Fp8Linear.from_linear(linear))
        else:
            model.set_submodule(path, SplitRowFp8(linear, [plan.splits[path].index for plan in plans]))
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


def worker(rank: int, size: int, init_file: str, cases: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        results = {case: logits_errors(name, overrides, tp, how, Path(f"{out}-{case}"))
                   for case, name, overrides, how in cases}
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
