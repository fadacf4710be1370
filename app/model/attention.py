"""Paged, GQA-native attention plugged into transformers' own model through its AttentionInterface.

The model runner flattens every sequence of a step into one row of tokens ([1, T]: decode rows first,
one token each, then prefill chunks) and hands each attention module the step's `AttentionMetadata`.
transformers computes q/k/v and RoPE as usual and then calls `paged_attention`, which writes the new
K/V into the preallocated paged cache and attends:
- decode rows: one batched call of the Triton kernel (app/model/kernels/attention.py) on CUDA, which reads each
  K/V token once per group of query heads (no repeat_kv), inside a CUDA graph; its reference on CPU;
- prefill chunks: per sequence, SDPA over the sequence's cached K/V (causal; bottom-right aligned when
  earlier chunks are cached, see `_prefill_one`), or all at once through varlen flash attention on CUDA.
Registering a name that has no mask function makes transformers skip its own mask building, so every path
applies what the architecture declares (app/model/architectures.py) for each layer itself: its sliding window
and its score soft-capping.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from app.engine.kv_blocks import blocks_for
from app.model.architectures import Architecture, head_dim
from app.model.kernels import attention as kernels

ATTENTION_NAME = "lora_serve_paged"
# Not cuDNN, which torch prefers on Hopper: it builds a plan for every new sequence length, and every
# prefill brings new lengths, so each prefill would pay that CPU time again in every layer.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache row (block * block_size + offset) that each token writes
    num_decode: int  # the first num_decode tokens are decode rows, one token each (padding rows included)
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decode] int32, 0 for a padding row
    decode_workspace: kernels.DecodeWorkspace | None  # preallocated split-K scratch (graphs), or None
    prefill_blocks: list[torch.Tensor]  # per prefill chunk: its block ids [n_blocks] long
    prefill_query_starts: list[int]  # [P + 1], relative to the first prefill token
    prefill_context_lens: list[int]  # [P]: cached tokens of each sequence once this chunk is written
    use_kernel: bool  # decode through Triton (CUDA) or the torch reference
    # All prefill chunks in one varlen flash call (CUDA, when torch has it), else per-sequence SDPA:
    prefill_kv_rows: torch.Tensor | None = None  # [sum of context lens] long: cache rows of every chunk's context
    prefill_cu_q: torch.Tensor | None = None  # [P + 1] int32: query offsets (= prefill_query_starts)
    prefill_cu_k: torch.Tensor | None = None  # [P + 1] int32: context offsets into prefill_kv_rows


class PagedKVCache:
    """The device K/V tensors, allocated once: [layers, num_blocks, block_size, kv_heads, head_dim] each."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_model(cls, model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> PagedKVCache:
        return cls(model_config.num_hidden_layers, num_blocks, block_size, model_config.num_key_value_heads,
                   head_dim(model_config), dtype, device)


def kv_cache_blocks(config, model_config, dtype: torch.dtype, device: torch.device, max_model_len: int) -> int:
    """KV cache blocks for an engine: config.kv_cache_bytes, else kv_cache_memory_fraction of the GPU memory free
    now (CPU: max_total_tokens); never more than every row at the model's full length can use (a small model
    on a big GPU would otherwise take tens of GB and millions of blocks for nothing). Block 0 is scratch."""
    per_block = PagedKVCache.bytes_per_block(model_config.num_hidden_layers, config.block_size,
                                             model_config.num_key_value_heads, head_dim(model_config), dtype)
    useful = 1 + config.max_batch_size * blocks_for(max_model_len, config.block_size)
    if config.kv_cache_bytes is not None:
        nbytes = config.kv_cache_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = int(free * config.kv_cache_memory_fraction)
    else:
        return min(useful, 1 + blocks_for(config.max_total_tokens, config.block_size))
    blocks = nbytes // per_block
    if blocks < 2:
        raise ValueError(f"kv_cache_bytes ({nbytes}) holds {blocks} blocks of {per_block} bytes; at least 2 are needed")
    return min(blocks, useful)


class AttentionState:
    """What the attention modules of one engine share: the cache and the current step's metadata."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.meta: AttentionMetadata | None = None


@torch.compiler.disable  # opaque to torch.compile: Triton kernels and per-step metadata, run as they are
def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, **kwargs):
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    state: AttentionState = module.paged_state
    meta, layer = state.meta, module.layer_idx
    window, cap = module.paged_window, module.paged_softcap
    if (sliding_window, softcap) != (window, cap):  # a wrong declaration would serve other attention: stop
        raise RuntimeError(f"layer {layer}: transformers asks for sliding_window={sliding_window}, "
                           f"softcap={softcap}; the architecture declares {window}, {cap}")
    k_cache, v_cache = state.cache.k[layer], state.cache.v[layer]
    q = query[0].transpose(0, 1)  # [T, H, D]
    _, kv_heads, head_dim = k_cache.shape[1:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))
    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd:
        if meta.use_kernel:
            kernels.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                           scaling, out=out[:nd], workspace=meta.decode_workspace, window=window,
                                           softcap=cap)
        else:
            out[:nd] = kernels.paged_decode_reference(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                      meta.decode_context_lens, scaling, window, cap)
    if meta.prefill_kv_rows is not None:
        out[nd:] = _prefill_varlen(q[nd:], k_cache, v_cache, meta, scaling, window)
        return out.unsqueeze(0), None
    starts = meta.prefill_query_starts
    with sdpa_kernel(PREFILL_BACKENDS):
        for i, length in enumerate(meta.prefill_context_lens):
            first, last = nd + starts[i], nd + starts[i + 1]
            out[first:last] = _prefill_one(q[first:last], k_cache, v_cache, meta.prefill_blocks[i], length, scaling,
                                           window, cap)
    return out.unsqueeze(0), None


def _prefill_one(q, k_cache, v_cache, blocks, length, scale, window=None, softcap=None):
    """One sequence's chunk of n queries, the last n of its `length` cached tokens: [n, H, D].

    SDPA's fused kernels take only 4-D inputs. With no cached prefix the causal flash kernel runs with
    `enable_gqa` (K/V read once per group). A later chunk needs a bottom-right mask, which flash does not
    take and the memory-efficient kernel takes only without `enable_gqa`, so there K/V are repeated per
    query head for this one sequence (a copy of its context, small beside the chunk's GEMMs); so does a
    sliding window. SDPA cannot cap scores: soft-capped layers run kernels.attend in fp32.
    """
    n = q.shape[0]
    k = k_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = v_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)[None]
    q = q.transpose(0, 1)[None]  # [1, H, n, D]
    if softcap is not None:
        mask = kernels.window_mask(length, n, window, q.device)
        o = kernels.attend(q[0], k[0], v[0], scale, mask, softcap)[None]
    elif n == length and window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        group = q.shape[1] // k.shape[1]
        mask = kernels.window_mask(length, n, window, q.device)  # bottom-right causal
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _varlen_call():
    """torch's varlen flash attention (torch.nn.attention.varlen) as
    f(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None), and whether it takes a window; None where this
    torch has none. Its signature changed across releases: later ones take `window_size` and `scale` (and later
    `enable_gqa`); the first took `is_causal` and the default scale only."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # flash takes fewer K/V heads natively; later releases ask for enable_gqa
        gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
        # flash's left window counts the keys before the query's own: `window` tokens in all, as transformers'.
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None: varlen_attn(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
            window_size=(-1 if window is None else window - 1, 0), **gqa), True
    if "is_causal" in params:
        def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
            if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
                raise NotImplementedError("this torch's varlen_attn takes the default scale only")
            if window is not None:
                raise NotImplementedError("this torch's varlen_attn takes no sliding window")
            return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True)
        return call, False
    return None, False


VARLEN, VARLEN_WINDOWS = _varlen_call()


def _prefill_varlen(q, k_cache, v_cache, meta: AttentionMetadata, scale, window):
    """Every prefill chunk of the step in one flash call: q [Tp, H, D] -> [Tp, H, D]. Each chunk's context
    (earlier chunks included) is gathered from the paged cache into one packed K/V; flash's causal mask is
    aligned bottom-right when a chunk's queries are the last of a longer context, and it reads each K/V
    head once per group of query heads (no repeat_kv)."""
    _, _, kv_heads, head_dim = k_cache.shape
    k = k_cache.view(-1, kv_heads, head_dim).index_select(0, meta.prefill_kv_rows)
    v = v_cache.view(-1, kv_heads, head_dim).index_select(0, meta.prefill_kv_rows)
    starts, lens = meta.prefill_query_starts, meta.prefill_context_lens
    max_q = max(b - a for a, b in zip(starts, starts[1:]))
    args = (q, k, v, meta.prefill_cu_q, meta.prefill_cu_k, max_q, max(lens), scale)
    return VARLEN(*args) if window is None else VARLEN(*args, window)


def kernel_supports(head_dim: int, device: torch.device) -> bool:
    return device.type == "cuda" and kernels.triton is not None and head_dim in kernels.HEAD_DIMS


def varlen_supports(arch: Architecture, model_config) -> bool:
    """Whether this torch's varlen flash computes every layer's prefill exactly: it caps no scores, and only
    later releases take a window."""
    if VARLEN is None or arch.attention_softcap(model_config) is not None:
        return False
    return VARLEN_WINDOWS or all(window is None for window in arch.windows(model_config))


def install(model, state: AttentionState, arch: Architecture) -> None:
    """Point every attention module of `model` at `state`, with its layer's window and soft-cap as `arch`
    declares them, and switch the model to paged attention."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    config = model.config
    layers = model.get_submodule(arch.layers)
    windows = arch.windows(config)
    if len(windows) != len(layers):
        raise RuntimeError(f"{arch.name}: {len(windows)} layer windows for {len(layers)} layers")
    for layer, window in zip(layers, windows):
        layer.self_attn.paged_state = state
        layer.self_attn.paged_window = window
        layer.self_attn.paged_softcap = arch.attention_softcap(config)
    config._attn_implementation = ATTENTION_NAME
