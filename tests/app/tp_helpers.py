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
from transformers import AutoModelForCausalLM

from app.adapters.targets import target_shapes
from app.engine.workers import shard_parts
from app.model.architectures import check_supported
from app.model.lora import LoRAMetadata, LoRASlots, segments
from app.model.tensor_parallel import TensorParallel, load_shard, shard_model
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


def logits_errors(name: str, overrides: dict, tp: TensorParallel, checkpoint: Path | None) -> dict:
    """Largest differences from the unsharded logits: the base row against the base model, the adapter row
    against PEFT. With a checkpoint folder, the rank reads its shard from the model saved there (load_shard);
    without, it shards the whole model (shard_model)."""
    model, peft, adapter, arch = build(name, overrides)
    ids = torch.randint(3, 1000, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits, peft_logits = model(ids).logits, peft(ids).logits
    if checkpoint is None:
        plan = shard_model(model, arch, tp)
    else:
        if tp.rank == 0:  # every rank built the same model; transformers saves on rank 0 alone
            model.save_pretrained(checkpoint)
        dist.barrier()
        model, plan = load_shard(checkpoint, model.config, arch, tp, torch.float32, torch.device("cpu"))
        model.config._attn_implementation = "eager"
    layout = PageLayout(target_shapes(model.config), max_rank=RANK, page_rows=RANK)
    lora = LoRASlots(model, layout, num_pages=2, num_slots=1, t_cap=2 * PROMPT)
    flat = {path: (a.flatten(), b.flatten(), RANK, ALPHA / RANK) for path, (a, b) in adapter.items()}
    parts = shard_parts(plan, flat)
    host = [torch.empty(layout.page_numel)]
    lora.write_slot(0, [0], host, layout.pack(parts, host), RANK)
    order, starts, slots = segments([-1] * PROMPT + [0] * PROMPT, 2 * PROMPT, 2 * PROMPT)
    lora.ctx.meta = LoRAMetadata(*(torch.tensor(v, dtype=torch.int32) for v in (order, starts, slots)))
    with torch.no_grad():
        got = model(ids).logits
    return {"base": (got[0] - base_logits[0]).abs().max().item(),
            "adapter": (got[1] - peft_logits[1]).abs().max().item(),
            "adapter_effect": (peft_logits[1] - base_logits[1]).abs().max().item(),
            "local_heads": model.config.num_attention_heads}


def worker(rank: int, size: int, init_file: str, cases: list, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        results = {case: logits_errors(name, overrides, tp, Path(f"{out}-{case}") if from_checkpoint else None)
                   for case, name, overrides, from_checkpoint in cases}
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
