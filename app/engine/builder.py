"""Builds what an engine runs on from its config: the model and tokenizer, the adapter registry, the device
adapter pool and its residency, the KV cache and the model runner.

The order is the device memory's: the weights load first, the adapter pool is sized (and allocated) from what
they leave, the KV cache takes its share of what is left after that, and the runner captures its graphs last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from app.adapters.registry import AdapterRegistry
from app.adapters.uris import is_remote
from app.adapters.targets import pool_shapes, target_shapes
from app.engine.config import EngineConfig
from app.engine.kv_blocks import BlockManager
from app.engine.model_runner import ModelRunner
from app.engine.workers import Sizes, Workers, adapter_registry, check_tensor_parallel_config, shard_parts
from app.model.architectures import UnsupportedModel, check_supported
from app.model.attention import PagedKVCache, kv_cache_blocks
from app.model.fp8 import check_fp8_device, quantize_linears
from app.model.fp8_checkpoint import dense_config, fp8_scheme, load_fp8_linears
from app.model.lora import LoRASlots, pool_size
from app.model.tensor_parallel import TensorParallel, load_shard
from app.sampling.structured import GrammarCompiler
from prefetch.layout import PageLayout
from prefetch.residency import Residency
from prefetch.slot_pool import SlotPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """An engine's collaborators, each whole: the engine wires none of them itself."""

    device: torch.device
    dtype: torch.dtype
    tokenizer: PreTrainedTokenizerBase
    model_config: PretrainedConfig
    max_model_len: int
    eos_ids: set[int]
    registry: AdapterRegistry
    grammars: GrammarCompiler
    lora: LoRASlots  # the model's target linears, wrapped, and the device adapter pool they read
    residency: Residency
    blocks: BlockManager
    runner: ModelRunner


def build_parts(config: EngineConfig) -> EngineParts:
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    model_config = AutoConfig.from_pretrained(config.base_model)
    arch = check_supported(model_config)  # before the weights load: refused by name
    checkpoint, _ = fp8_scheme(model_config)  # an FP8 checkpoint's weights are served as they are
    if config.quantization == "fp8" or checkpoint is not None:
        check_fp8_device(device)
    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    workers, plan = None, None
    if config.tensor_parallel_size > 1:
        _check_tensor_parallel(config, model_config)
        workers = Workers.start(config)  # the other ranks load their shards meanwhile
        model, plan = load_shard(Path(config.base_model), model_config, arch,
                                 TensorParallel(0, config.tensor_parallel_size), dtype, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            config.base_model, config=model_config if checkpoint is None else dense_config(model_config),
            dtype=dtype).to(device).eval()
    if checkpoint is not None:  # a rank's shard of it loads as FP8 in load_shard
        if plan is None:
            load_fp8_linears(model, Path(config.base_model), arch.target_shapes(model.config), checkpoint)
        log.info("serving the checkpoint's FP8 linear projections (a scale per %s)", checkpoint.weight_strategy)
    elif config.quantization == "fp8":
        count = quantize_linears(model, arch.target_shapes(model.config))
        log.info("quantized %d linear projections to FP8 (a scale per output channel)", count)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # dense weights replaced by FP8 ones: for the adapter pool and KV cache sized below
    max_model_len = model.config.max_position_embeddings
    remote = any(is_remote(root) for root in config.adapter_roots)
    registry = adapter_registry(config, model_config)
    layout = PageLayout(pool_shapes(target_shapes(model.config), config.target_modules), config.max_rank,
                        config.adapter_page_rows)
    num_pages, num_slots = pool_size(config, layout, dtype, device)
    # A step feeds at most the prefill budget plus one token per decode row; prompt_logits feeds a whole prompt.
    max_step_tokens = max(max(config.max_prefill_tokens_per_step, config.max_input_tokens) + config.max_batch_size,
                          config.max_graph_tokens)  # a graph bucket's padded rows too
    lora = LoRASlots(model, layout, num_pages, num_slots, t_cap=max_step_tokens)
    pool = SlotPool(num_pages, num_slots)
    read_parts, began = partial(_read_parts, registry), None
    if workers is not None:  # rank 0 holds its shard of each adapter; each load begins on the other ranks too
        read_parts = partial(_read_shard, registry, plan)
        began = partial(_begin_everywhere, pool, registry, workers)
    residency = Residency(config, layout, pool, lora.write_slot, read_parts,
                          lambda adapter_id: registry.get(adapter_id).rank, device, dtype,
                          *((registry.fetch_ahead, registry.on_node, registry.is_fetching) if remote else
                            (None, None, None)), began=began)
    blocks = BlockManager(kv_cache_blocks(config, model.config, dtype, device, max_model_len), config.block_size)
    if workers is not None:
        workers.send_sizes(Sizes(num_pages, num_slots, blocks.num_blocks, max_step_tokens))
    cache = PagedKVCache.for_model(model.config, blocks.num_blocks, config.block_size, dtype, device)
    runner = ModelRunner(model, lora, blocks, cache, config.max_batch_size, max_model_len,
                         use_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
                         max_graph_tokens=config.max_graph_tokens, workers=workers)
    log.info("KV cache: %d blocks of %d tokens (%.2f GB); adapter pool: %d pages, up to %d adapters (%.2f GB); "
             "decode graphs: %s", blocks.num_blocks, config.block_size,
             cache.k.numel() * cache.k.element_size() * 2 / 1e9, num_pages, num_slots, lora.nbytes() / 1e9,
             runner.graph_batches or "none")
    eos_ids = _eos_ids(model, tokenizer)
    return EngineParts(device, dtype, tokenizer, model.config, max_model_len, eos_ids, registry,
                       GrammarCompiler(tokenizer, model.config.vocab_size, eos_ids), lora, residency, blocks, runner)


def _check_tensor_parallel(config: EngineConfig, model_config: PretrainedConfig) -> None:
    check_tensor_parallel_config(config, model_config)
    size = config.tensor_parallel_size
    if config.torch_device().type == "cuda" and torch.cuda.device_count() < size:
        raise UnsupportedModel(f"tensor_parallel_size {size} needs {size} GPUs; this process sees "
                               f"{torch.cuda.device_count()}")


def _begin_everywhere(pool: SlotPool, registry: AdapterRegistry, workers: Workers, slot: int, adapter_id: str) -> None:
    workers.load(slot, pool.slots[slot].pages, registry.get(adapter_id))


def _read_shard(registry: AdapterRegistry, plan, adapter_id: str):
    return shard_parts(plan, _read_parts(registry, adapter_id))


def _read_parts(registry: AdapterRegistry, adapter_id: str):
    # Worker thread. The residency bound-checks the packed weights (NaN/Inf included), so the
    # registry's own NaN scan would only read every byte a second time.
    return registry.read(registry.get(adapter_id), check_finite=False).flat_parts()


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
