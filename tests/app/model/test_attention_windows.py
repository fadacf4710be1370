"""Sliding windows and score soft-capping in every attention path: the plain-torch references and the engine's
per-sequence prefill against the naive loop (CPU), the Triton decode kernel at head sizes 64 to 256 in Triton's
CPU interpreter (attention_interpret.py, when triton is importable) and on CUDA (marker `gpu`, eagerly and replayed
in a CUDA graph), and varlen flash's window on CUDA."""

import importlib.util
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.model import attention as attention_module
from app.model.kernels.attention import (decode_workspace, paged_decode_attention, paged_decode_reference,
                                         paged_prefill_reference, window_mask)
from test_attention_kernels import BF16_ATOL, make_paged, naive_keys

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WINDOWS_AND_CAPS = [(None, 2.0), (1, None), (5, None), (16, None), (17, 3.0), (40, None), (1000, None)]


def naive(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale, window, softcap):
    """Query t of a sequence's n new tokens is token p = L - n + t; it sees tokens j <= p with j > p - window,
    its scores capped by softcap * tanh(s / softcap). In fp64."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(context_lens.tolist()):
        first, last = int(query_starts[i]), int(query_starts[i + 1])
        if length == 0:  # a padding row: output 0
            continue
        keys = naive_keys(k_cache, block_tables[i], length).double()
        values = naive_keys(v_cache, block_tables[i], length).double()
        for t in range(last - first):
            p = length - (last - first) + t
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(q.shape[1]):
                s = scale * q[first + t, h].double() @ keys[lo:p + 1, h // group].T
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                out[first + t, h] = torch.softmax(s, dim=0) @ values[lo:p + 1, h // group]
    return out


def test_window_mask_keeps_the_last_window_tokens_of_each_query():
    mask = window_mask(length=6, n=3, window=2, device="cpu")  # queries are tokens 3, 4, 5
    assert mask.int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
def test_decode_reference_matches_naive_loop(window, softcap):
    lengths = [1, 0, 16, 53, 2, 77]
    q, k, v, tables, lens = make_paged(lengths, num_heads=8, num_kv_heads=2)
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_reference(q, k, v, tables, lens, scale, window, softcap)
    starts = torch.arange(len(lengths) + 1)
    expected = naive(q, k, v, tables, starts, lens, scale, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def chunks(new_and_prefix, group=4):
    """Sequences of n new tokens after a cached prefix: (q, k, v, tables, query_starts, lens)."""
    lengths = [n + prefix for n, prefix in new_and_prefix]
    q_all, k, v, tables, lens = make_paged(lengths, num_heads=2 * group, num_kv_heads=2)
    counts = [n for n, _ in new_and_prefix]
    starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).int()
    q = torch.randn(sum(counts), *q_all.shape[1:], generator=torch.Generator().manual_seed(1))
    return q, k, v, tables, starts, lens


PREFILLS = [[(5, 0)], [(1, 0), (7, 0), (23, 0)], [(3, 29), (1, 40), (17, 16)]]


@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("new_and_prefix", PREFILLS)
def test_prefill_reference_and_the_engines_cpu_prefill_match_naive_loop(window, softcap, new_and_prefix):
    q, k, v, tables, starts, lens = chunks(new_and_prefix)
    scale = 1 / math.sqrt(q.shape[-1])
    expected = naive(q, k, v, tables, starts, lens, scale, window, softcap)
    got = paged_prefill_reference(q, k, v, tables, starts, lens, scale, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    for i, length in enumerate(lens.tolist()):  # the engine's per-sequence path (CPU, and CUDA without varlen)
        first, last = int(starts[i]), int(starts[i + 1])
        blocks = tables[i, : -(-length // k.shape[1])].long()
        one = attention_module._prefill_one(q[first:last], k, v, blocks, length, scale, window, softcap)
        torch.testing.assert_close(one.double(), expected[first:last], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (any build) for its interpreter")
def test_triton_decode_in_the_cpu_interpreter():
    """The kernel the GPU runs, windowed and capped, interpreted on CPU tensors (TRITON_INTERPRET=1, in a fresh
    process: the flag is read when triton is imported)."""
    script = Path(__file__).with_name("attention_interpret.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(script.parents[2]), *sys.path])}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all interpreter cases match" in result.stdout


# --------------------------------------------------------------------------------------------- CUDA

GPU_CASES = [  # (lengths, heads, kv heads, head_dim, block_size, window, softcap)
    ([1, 0, 17, 512, 1000, 4096], 32, 8, 128, 16, 4096, None),  # Mistral-7B-v0.1's window
    ([1, 0, 17, 512, 1000, 3000], 32, 8, 128, 16, 2047, None),  # Phi-3-mini's
    ([5, 63, 64, 65, 700], 16, 8, 128, 16, 64, None),
    ([5, 63, 64, 65, 700], 16, 8, 64, 32, 37, 50.0),
    ([300, 1, 2049], 8, 4, 128, 16, None, 30.0),
    ([1, 0, 17, 512, 1000, 4200], 16, 8, 256, 16, 4096, 50.0),  # Gemma-2-9B's sliding layers
    ([1, 0, 17, 512, 1000, 4200], 16, 8, 256, 16, None, 50.0),  # and its full ones
    ([5, 63, 64, 65, 700], 8, 4, 256, 32, 37, 1.0),  # a cap that bites on these scores
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_triton_decode_matches_reference(case, num_splits):
    lengths, heads, kv_heads, head_dim, block_size, window, softcap = GPU_CASES[case]
    q, k, v, tables, lens = make_paged(lengths, heads, kv_heads, head_dim, block_size, torch.bfloat16, "cuda")
    k[0], v[0] = float("nan"), float("nan")
    workspace = decode_workspace(q, kv_heads, tables, block_size, num_splits=num_splits)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k, v, tables, lens, scale, workspace=workspace, window=window, softcap=softcap)
    expected = paged_decode_reference(q, k, v, tables, lens, scale, window, softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads, head_dim, softcap", [(32, 128, None), (16, 256, 2.0)])
def test_triton_decode_window_replays_in_a_graph_after_inputs_change(heads, head_dim, softcap):
    batch, window = 8, 100
    q, k, v, tables, lens = make_paged([300] * batch, heads, 8, head_dim, 16, torch.bfloat16, "cuda",
                                       spare_blocks=120)
    out, workspace = torch.empty_like(q), decode_workspace(q, 8, tables, 16)
    paged_decode_attention(q, k, v, tables, lens, 0.1, out=out, workspace=workspace, window=window, softcap=softcap)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, tables, lens, 0.1, out=out, workspace=workspace, window=window,
                               softcap=softcap)
    for seed, new_lengths in enumerate([[1, 0, 17, 1600, 5, 0, 1711, 64], [99, 100, 101, 1, 0, 0, 0, 2000]]):
        gen = torch.Generator().manual_seed(seed)
        tables.copy_((1 + torch.randperm(k.shape[0] - 1, generator=gen)).view_as(tables))
        lens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        expected = paged_decode_reference(q, k, v, tables, lens, 0.1, window, softcap)
        torch.testing.assert_close(out.float(), expected.float(), atol=BF16_ATOL, rtol=BF16_ATOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not attention_module.VARLEN_WINDOWS, reason="this torch's varlen flash takes no window")
@pytest.mark.parametrize("window", [1, 7, 64])
def test_varlen_prefill_window_matches_the_packed_reference(window):
    """flash's window counts the query's own key: `window` keys in all, as transformers' sliding_window."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 128
    lens_q, lens_k = [5, 64, 17, 1], [5, 100, 40, 33]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    got = attention_module.VARLEN(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dim ** -0.5, window)
    for i in range(len(lens_q)):
        qs, ks, vs = (t.float().cpu() for t in (q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]))
        mask = window_mask(len(ks), len(qs), window, "cpu")
        want = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=dim ** -0.5,
            enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got[cu_q[i]:cu_q[i + 1]].float().cpu(), want, atol=2e-2, rtol=2e-2)
