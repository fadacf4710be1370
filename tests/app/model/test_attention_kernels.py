"""Paged attention: the plain-torch references against the naive loop (CPU), the Triton decode kernel against
the reference (marker `gpu`), and the kernel replayed in a CUDA graph after its inputs change in place."""

import itertools
import math

import pytest
import torch

from app.model import attention as attention_module
from app.model.kernels import attention as kernels
from app.model.kernels.attention import (decode_workspace, paged_decode_attention, paged_decode_reference,
                                         paged_prefill_reference, tile_tokens)
from engine_helpers import packed_reference

BF16_ATOL = 1e-2  # bf16 kernel vs fp32 reference, outputs of magnitude <~ 1


def make_paged(lengths, num_heads, num_kv_heads, head_dim=64, block_size=16, dtype=torch.float32,
               device="cpu", spare_blocks=3, seed=0):
    """Random caches and queries; each row's blocks drawn from a shuffled pool, block 0 never handed out."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in lengths)) + spare_blocks
    num_blocks = 1 + len(lengths) * max_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    block_tables = (1 + torch.randperm(num_blocks - 1, generator=gen)).view(len(lengths), max_blocks)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(device, dtype)
    return (q, k_cache, v_cache, block_tables.int().to(device),
            torch.tensor(lengths, dtype=torch.int32, device=device))


def naive_keys(cache, block_table, length):
    block_size = cache.shape[1]
    return torch.stack([cache[block_table[j // block_size], j % block_size] for j in range(length)])  # [L, Hkv, D]


def naive_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The module docstring's loop, word for word, in fp64."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        length = int(context_lens[b])
        if length == 0:
            continue
        keys = naive_keys(k_cache, block_tables[b], length).double()
        values = naive_keys(v_cache, block_tables[b], length).double()
        for h in range(num_heads):
            p = torch.softmax(scale * q[b, h].double() @ keys[:, h // group].T, dim=0)
            out[b, h] = p @ values[:, h // group]
    return out


def naive_prefill(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale):
    """Query t of a sequence's n new tokens is token L - n + t and sees tokens 0..L - n + t."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(context_lens.tolist()):
        first, last = int(query_starts[i]), int(query_starts[i + 1])
        keys = naive_keys(k_cache, block_tables[i], length).double()
        values = naive_keys(v_cache, block_tables[i], length).double()
        for t in range(last - first):
            visible = length - (last - first) + t + 1
            for h in range(num_heads):
                p = torch.softmax(scale * q[first + t, h].double() @ keys[:visible, h // group].T, dim=0)
                out[first + t, h] = p @ values[:visible, h // group]
    return out


# --------------------------------------------------------------------------------------------- CPU references

@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_matches_naive_loop(group, block_size):
    lengths = [1, 0, block_size, 3 * block_size + 5, 2, 0, 77]
    q, k, v, tables, lens = make_paged(lengths, num_heads=2 * group, num_kv_heads=2, block_size=block_size)
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_reference(q, k, v, tables, lens, scale)
    torch.testing.assert_close(got.double(), naive_decode(q, k, v, tables, lens, scale), atol=1e-5, rtol=1e-5)
    assert got[1].abs().max() == 0 and got[5].abs().max() == 0  # padding rows


def test_decode_reference_keeps_dtype_and_ignores_scratch_block():
    q, k, v, tables, lens = make_paged([5, 40], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16)
    k[0], v[0] = float("nan"), float("nan")  # block 0 is never in a table; NaN there must not leak
    got = paged_decode_reference(q, k, v, tables, lens, 0.125)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), naive_decode(q, k, v, tables, lens, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("new_and_prefix", [
    [(5, 0)],                       # one sequence, no prefix: plain causal
    [(1, 0), (7, 0), (16, 0)],      # several sequences, no prefix, one of a single token
    [(3, 29), (1, 40), (17, 16)],   # chunks after a cached prefix (bottom-right causal)
    [(20, 0), (4, 13), (1, 0)],     # mixed
])
def test_prefill_reference_matches_naive_loop(group, new_and_prefix):
    lengths = [n + prefix for n, prefix in new_and_prefix]
    q_all, k, v, tables, lens = make_paged(lengths, num_heads=2 * group, num_kv_heads=2)
    counts = [n for n, _ in new_and_prefix]
    query_starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).int()
    q = torch.randn(sum(counts), *q_all.shape[1:], generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_prefill_reference(q, k, v, tables, query_starts, lens, scale)
    expected = naive_prefill(q, k, v, tables, query_starts, lens, scale)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_last_token_equals_decode():
    lengths = [9, 33, 1]
    q, k, v, tables, lens = make_paged(lengths, num_heads=8, num_kv_heads=2)
    query_starts = torch.arange(len(lengths) + 1, dtype=torch.int32)  # one new token per sequence
    torch.testing.assert_close(paged_prefill_reference(q, k, v, tables, query_starts, lens, 0.1),
                               paged_decode_reference(q, k, v, tables, lens, 0.1))


def test_prefill_reference_rejects_more_queries_than_cached_tokens():
    q, k, v, tables, lens = make_paged([4], num_heads=2, num_kv_heads=1)
    q = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="5 queries but only 4"):
        paged_prefill_reference(q, k, v, tables, torch.tensor([0, 5], dtype=torch.int32), lens, 0.1)


def test_tiles_keep_their_bytes_above_head_dim_128():
    """64 and 128 tile as they always have; 256 holds half the tokens, at least one block."""
    for tokens_per_split, tokens in ((512, 64), (8192, 128)):
        assert tile_tokens(64, tokens_per_split, 16) == tile_tokens(128, tokens_per_split, 16) == tokens
        assert tile_tokens(256, tokens_per_split, 16) == tokens // 2
    assert tile_tokens(256, 512, 64) == 64


def test_the_kernel_and_its_graphs_take_gemmas_head_dim():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing runs on them
    assert kernels.HEAD_DIMS == (64, 128, 256)
    assert all(attention_module.kernel_supports(d, cuda) == (kernels.triton is not None) for d in (64, 128, 256))
    assert not attention_module.kernel_supports(96, cuda) and not attention_module.kernel_supports(256, cpu)


# --------------------------------------------------------------------------------------------- Triton on CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_lengths(batch, low, high, seed):
    return torch.randint(low, high + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()


DECODE_CASES = {  # name: (lengths, num_heads, num_kv_heads, head_dim, block_size, dtype)
    "b1-len1": ([1], 32, 8, 128, 16, torch.bfloat16),
    "b1-len4096": ([4096], 32, 8, 128, 16, torch.bfloat16),
    "b1-len8191-g1": ([8191], 8, 8, 128, 16, torch.bfloat16),
    "b5-padding": ([0, 1, 17, 512, 1000], 32, 4, 128, 16, torch.bfloat16),
    "b64-upto1024": (random_lengths(64, 1, 1024, 0), 32, 8, 128, 16, torch.bfloat16),
    "b16-upto4096-d64-bs32": (random_lengths(16, 1, 4096, 1), 16, 16, 64, 32, torch.bfloat16),
    "b8-upto2048-g8-bs64-fp16": (random_lengths(8, 1, 2048, 2), 64, 8, 64, 64, torch.float16),
    "b33-upto300-g7": (random_lengths(33, 1, 300, 3), 28, 4, 128, 16, torch.bfloat16),
    "b3-all-padding": ([0, 0, 0], 32, 8, 128, 16, torch.bfloat16),
    # head_dim 256, Gemma-2-9B's heads (16 over 8 kv heads): split (batch 1) and unsplit (batch 32), 32-token tiles;
    # test_triton_decode_any_split_count's single split runs its 64-token tiles
    "b1-len4096-d256": ([4096], 16, 8, 256, 16, torch.bfloat16),
    "b32-upto600-d256": (random_lengths(32, 1, 600, 4), 16, 8, 256, 16, torch.bfloat16),
    "b5-padding-d256-g4-bs32-fp16": ([0, 1, 17, 512, 1000], 16, 4, 256, 32, torch.float16),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_triton_decode_matches_reference(name):
    lengths, num_heads, num_kv_heads, head_dim, block_size, dtype = DECODE_CASES[name]
    q, k, v, tables, lens = make_paged(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    k[0], v[0] = float("nan"), float("nan")  # the scratch block must never be read into a result
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention(q, k, v, tables, lens, scale)
    expected = paged_decode_reference(q, k, v, tables, lens, scale)
    torch.testing.assert_close(got.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 3, 16, 64])
@pytest.mark.parametrize("heads, head_dim", [(32, 128), (16, 256)])
def test_triton_decode_any_split_count(num_splits, heads, head_dim):
    q, k, v, tables, lens = make_paged([1, 0, 63, 700, 2049], heads, 8, head_dim, 16, torch.bfloat16, "cuda")
    workspace = decode_workspace(q, 8, tables, 16, num_splits=num_splits)
    got = paged_decode_attention(q, k, v, tables, lens, 0.09, workspace=workspace)
    expected = paged_decode_reference(q, k, v, tables, lens, 0.09)
    torch.testing.assert_close(got.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads, head_dim", [(32, 128), (16, 256)])
def test_triton_decode_graph_replay_after_inputs_change_in_place(heads, head_dim):
    batch, block_size = 8, 16
    q, k, v, tables, lens = make_paged([300] * batch, heads, 8, head_dim, block_size, torch.bfloat16, "cuda",
                                       spare_blocks=120)  # room for 2224 tokens
    out = torch.empty_like(q)
    workspace = decode_workspace(q, 8, tables, block_size)
    paged_decode_attention(q, k, v, tables, lens, 0.1, out=out, workspace=workspace)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, tables, lens, 0.1, out=out, workspace=workspace)
    for seed, new_lengths in enumerate([[1, 0, 17, 1600, 5, 0, 1711, 64], [1, 1, 1, 1, 0, 0, 0, 2000]]):
        gen = torch.Generator().manual_seed(seed)
        tables.copy_((1 + torch.randperm(k.shape[0] - 1, generator=gen)).view_as(tables))
        lens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_decode_reference(q, k, v, tables, lens, 0.1)
        torch.testing.assert_close(out.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(attention_module.VARLEN is None, reason="this torch has no varlen flash attention")
def test_varlen_prefill_matches_the_packed_reference():
    """torch's varlen flash (one call for every prefill chunk of a step) against its contract: causal and
    bottom-right aligned when a chunk continues a cached context, GQA without repeated K/V."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 128
    lens_q, lens_k = [5, 64, 17, 1], [5, 100, 40, 33]  # whole prompts and continuation chunks
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    got = attention_module.VARLEN(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dim ** -0.5)
    want = packed_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu_q.cpu(), cu_k.cpu(),
                            max(lens_q), max(lens_k), dim ** -0.5)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
